//! One handler call with its deadline, and what its failure means for the pass.

use std::time::{Duration, Instant};

use super::context::ApplyContext;
use crate::perspective::{ApplyError, ApplyTx, EventEnvelope, Perspective};
use crate::pipeline::settle::HEALTH_PROBE;
use crate::store::{WorkStore, WorkTx};
use crate::telemetry::metrics as m;

/// How one handler call ended badly.
pub(super) enum Failure {
    /// The handler returned an error.
    Error(ApplyError),
    /// It outlived `worker.apply_timeout` (its statement may still run on the connection).
    TimedOut,
}

/// Calls `perspective` for `ev` in `tx` with the apply deadline, and records its duration.
pub(super) async fn call<S: WorkStore>(
    ctx: &ApplyContext<S>,
    perspective: &dyn Perspective,
    ev: &EventEnvelope,
    tx: &mut S::Tx,
) -> Result<(), Failure> {
    let started = Instant::now();
    // A little later than the statement_timeout of SQL perspectives, so their statements end
    // cleanly on the server (a savepoint can roll back) before the transaction is given up.
    let deadline = ctx.apply_timeout + Duration::from_millis(250);
    let mut apply_tx = match tx.connection() {
        Some(conn) => ApplyTx::postgres(conn),
        None => ApplyTx::none(),
    };
    let result = tokio::time::timeout(deadline, perspective.apply(ev, &mut apply_tx)).await;
    metrics::histogram!(m::APPLY_DURATION_SECONDS, m::LABEL_PERSPECTIVE => ev.perspective_name.clone())
        .record(started.elapsed().as_secs_f64());
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Failure::Error(e)),
        Err(_) => Err(Failure::TimedOut),
    }
}

/// The error text of a call that outlived its deadline.
pub(super) fn timed_out<S: WorkStore>(ctx: &ApplyContext<S>) -> String {
    format!(
        "apply timed out after {} (worker.apply_timeout)",
        humantime::format_duration(ctx.apply_timeout)
    )
}

/// What a handler's error means for the pass, once the database has been asked.
pub(super) enum Verdict {
    /// Charge the row (retryable), in this transaction.
    Charge(String),
    /// Dead-letter the row (permanent), in this transaction.
    Permanent(String),
    /// A lock conflict: retry the transaction, uncharged (for a while).
    Conflict(String),
    /// The statement broke the transaction or its connection: charge it on its own.
    Poisoned(String),
    /// The database is gone: give everything back, charge nobody.
    Unavailable(String),
}

/// Judges a handler's error. Whether "the database is unavailable" is decided by asking the
/// database, never from the SQLSTATE the statement returned.
pub(super) async fn judge<S: WorkStore>(ctx: &ApplyContext<S>, error: ApplyError) -> Verdict {
    match error {
        ApplyError::Retryable(m) => Verdict::Charge(m),
        // Without a dead-letter store (the memory store) the row stays and is retried.
        ApplyError::Permanent(m) if !ctx.store.has_dead_letters() => Verdict::Charge(m),
        ApplyError::Permanent(m) => Verdict::Permanent(m),
        ApplyError::Conflict(m) => Verdict::Conflict(m),
        ApplyError::Unavailable(m) => {
            if database_answers(&ctx.store).await {
                // The database is fine: the statement failed by itself (it raised a connection
                // SQLSTATE, or killed its own backend).
                Verdict::Poisoned(m)
            } else {
                Verdict::Unavailable(m)
            }
        }
    }
}

/// Whether the database answers at all (on any connection of the pool, within a moment).
async fn database_answers<S: WorkStore>(store: &S) -> bool {
    matches!(
        tokio::time::timeout(HEALTH_PROBE, store.ping()).await,
        Ok(Ok(()))
    )
}

/// Whether a handler failed because a statement its connection had prepared and cached no
/// longer matches the schema (SQLSTATE 0A000, "cached plan must not change result type",
/// after an `ALTER TABLE` or a re-created function): a failure of the connection's statement
/// cache, which clearing it heals.
pub(super) fn is_stale_plan(e: &Failure) -> bool {
    matches!(e, Failure::Error(e) if e.message().contains("cached plan must not change result type"))
}
