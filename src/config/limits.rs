//! The bounds configuration enforces, named once: the parsers, the rules across keys and the
//! messages read them from here.

use std::time::Duration;

/// Largest value accepted for counts: they end up in SQL `int` parameters.
pub const MAX_SQL_INT: u64 = i32::MAX as u64;

/// Longest duration accepted for any key. The daemon takes small multiples of intervals (a
/// loop is flagged when silent for three of them), sends leases and backoffs to SQL as whole
/// seconds and `idle_in_transaction_session_timeout` as milliseconds in an `int`: a week keeps
/// every one far from overflow, and no interval of a live daemon needs more.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 60 * 60);
pub(super) const MAX_DURATION_TEXT: &str = "7d";

/// Most `worker.consumers`: each is a claim loop with a connection of its own, and more than
/// this only adds contention on the claim.
pub const MAX_CONSUMERS: usize = 256;

/// Connections beyond one per consumer the daemon needs: the work listener holds one, and the
/// background loops (heartbeat, lease renewal, sampler) share one.
pub const MIN_EXTRA_CONNECTIONS: u64 = 2;

/// Shortest `slo[].window`: the longest alert window (the ticket's 3 days) must fit in it.
pub const MIN_SLO_WINDOW: Duration = Duration::from_secs(3 * 24 * 60 * 60);
/// Longest `slo[].window`: a year.
pub const MAX_SLO_WINDOW: Duration = Duration::from_secs(365 * 24 * 60 * 60);
