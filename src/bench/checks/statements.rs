//! A perspective's statement as a data-modifying `WITH` against the same upsert written plainly:
//! what a read model pays for writing its statement the way many do. The apply's dispatcher
//! compiles any statement that returns no rows once per session (migration 0026); a statement
//! it runs through `EXECUTE` is parsed and planned for every event, which the third drain
//! shows (the `WITH` with a block comment the dispatcher does not read).

use super::{payload, small_n, CheckOutcome};
use crate::bench::drain::{self, DrainRun};
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};
use crate::store::bench::perspective_statement_as_with;

pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Statements);
    let n = small_n(bench);
    let streams = bench.config.streams.min(n).max(1);
    let seed = Seed::healthy(n, streams, 1, payload(bench));

    seed::apply(bench, &seed).await?;
    let plain = drain::drain(bench, &seed, "apply N, plain upsert").await?;
    let with = as_with(bench, &seed, false, "apply N, the upsert as a WITH").await?;
    let executed = as_with(bench, &seed, true, "apply N, the WITH through EXECUTE").await?;
    for run in [&plain, &with, &executed] {
        out.drain_line(run);
        if let Some(cpu) = run.per_event.server_cpu_us {
            out.details
                .push(format!("{}: server CPU {cpu:.0} µs a row", run.what));
        }
    }
    let time = |run: &DrainRun| run.elapsed.as_secs_f64().max(1e-9);
    out.ratio("WITH drain time / plain", time(&with) / time(&plain), None);
    out.ratio(
        "WITH through EXECUTE drain time / plain",
        time(&executed) / time(&plain),
        None,
    );
    Ok(out)
}

/// Seeds `seed` again and drains it with each perspective's statement written as a `WITH`.
async fn as_with(
    bench: &Bench,
    seed: &Seed,
    executed: bool,
    what: &str,
) -> Result<DrainRun, BenchError> {
    seed::apply(bench, seed).await?;
    drain::drain_with(bench, seed, what, |s| {
        for p in &mut s.perspectives {
            let statement = perspective_statement_as_with(&p.name, executed);
            for sql in p.sql.values_mut() {
                *sql = statement.clone();
            }
        }
    })
    .await
}
