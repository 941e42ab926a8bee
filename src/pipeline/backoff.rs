//! Retry backoff (docs/pipeline.md, "Ordering and failure").
//!
//! After a failed apply the row is parked until `now() + retry_delay(..)`. The delay is a
//! [`Duration`] rather than whole seconds because tests (and impatient deployments) use
//! millisecond backoffs; the storage layer passes it to SQL as an interval or milliseconds,
//! so rounding never turns a short backoff into none or into a full second.

use std::time::Duration;

/// The delay before retrying a row that has now failed `failures` times (this failure
/// included): `base × 2^(failures − 1)`, capped at `max`.
///
/// `1 → base`, `2 → 2 × base`, `3 → 4 × base`, … `0` is treated as `1`. Never overflows:
/// once the doubling would exceed `max` (or `Duration`), the result is `max`. A `base`
/// above `max` yields `max`.
pub fn retry_delay(failures: u32, base: Duration, max: Duration) -> Duration {
    let doublings = failures.saturating_sub(1);
    // 2^31 is the largest power of two a u32 multiplier holds; past it the cap has long won
    // for any non-zero base.
    let delay = match 1u32.checked_shl(doublings) {
        Some(factor) => base.checked_mul(factor).unwrap_or(max),
        None if base.is_zero() => Duration::ZERO,
        None => max,
    };
    delay.min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(300);

    #[test]
    fn doubles_from_base() {
        assert_eq!(retry_delay(1, BASE, MAX), BASE);
        assert_eq!(retry_delay(2, BASE, MAX), 2 * BASE);
        assert_eq!(retry_delay(3, BASE, MAX), 4 * BASE);
        assert_eq!(retry_delay(4, BASE, MAX), 8 * BASE);
        assert_eq!(retry_delay(9, BASE, MAX), 256 * BASE);
    }

    #[test]
    fn capped_at_max() {
        assert_eq!(retry_delay(10, BASE, MAX), MAX);
        assert_eq!(retry_delay(11, BASE, MAX), MAX);
        assert_eq!(retry_delay(1, Duration::from_secs(600), MAX), MAX);
    }

    #[test]
    fn no_overflow_for_large_counts() {
        assert_eq!(retry_delay(32, BASE, MAX), MAX);
        assert_eq!(retry_delay(33, BASE, MAX), MAX);
        assert_eq!(retry_delay(64, BASE, MAX), MAX);
        assert_eq!(retry_delay(1000, BASE, MAX), MAX);
        assert_eq!(retry_delay(u32::MAX, BASE, MAX), MAX);
        // Even with a cap at the edge of Duration.
        assert_eq!(retry_delay(1000, BASE, Duration::MAX), Duration::MAX);
        assert_eq!(retry_delay(2, Duration::MAX, Duration::MAX), Duration::MAX);
    }

    #[test]
    fn millisecond_backoffs() {
        let base = Duration::from_millis(10);
        let max = Duration::from_millis(50);
        assert_eq!(retry_delay(1, base, max), Duration::from_millis(10));
        assert_eq!(retry_delay(3, base, max), Duration::from_millis(40));
        assert_eq!(retry_delay(4, base, max), max);
    }

    #[test]
    fn zero_failures_and_zero_base() {
        assert_eq!(retry_delay(0, BASE, MAX), BASE);
        assert_eq!(retry_delay(1000, Duration::ZERO, MAX), Duration::ZERO);
    }
}
