//! The process's memory with the cooldown cache full.

use super::{payload, CheckOutcome, Target};
use crate::bench::drain::{self, DrainRun};
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};

pub(super) async fn run(bench: &Bench, main: &DrainRun) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Rss);
    let max_entries = bench.base_settings.cooldown.max_entries;
    let run = if main.cooldown_entries as u64 * 10 >= max_entries as u64 * 9 {
        main.clone()
    } else {
        let n = (max_entries as u64 * 11 / 10).max(1);
        let seed = Seed::healthy(n, bench.config.streams.min(n), 1, payload(bench));
        seed::apply(bench, &seed).await?;
        let run = drain::drain(bench, &seed, "fill the cooldown cache").await?;
        out.drain_line(&run);
        run
    };
    out.details.push(format!(
        "cooldown cache {} of {} entries; RSS {:.1} MiB at the end, peak {:.1} MiB (the whole bench process: daemon and harness)",
        run.cooldown_entries,
        max_entries,
        run.rss_kib as f64 / 1024.0,
        run.peak_rss_kib as f64 / 1024.0
    ));
    out.ratio(
        "peak RSS / 64 MiB",
        run.peak_rss_kib as f64 / 1024.0 / 64.0,
        Some(Target::AtMost(1.0)),
    );
    Ok(out)
}
