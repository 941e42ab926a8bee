//! Every metric vantage exports, named once (Prometheus conventions: `_total` counters,
//! `_seconds` durations). Dashboards and alerts in `deploy/` use exactly these names; a test
//! scrapes `/metrics` and checks.

/// Counter: rows moved to the dead letters, labels `perspective`, `reason`.
pub const DEAD_LETTER_MOVES_TOTAL: &str = "vantage_dead_letter_moves_total";
/// Counter: moves that failed with a database error (the row stayed in the apply set).
pub const DEAD_LETTER_MOVE_ERRORS_TOTAL: &str = "vantage_dead_letter_move_errors_total";
/// Counter: work rows claimed (returned to us by a claim), label `perspective`.
pub const EVENTS_CLAIMED_TOTAL: &str = "vantage_events_claimed_total";
/// Counter: events applied and completed, label `perspective`.
pub const EVENTS_APPLIED_TOTAL: &str = "vantage_events_applied_total";
/// Counter: apply failures recorded, label `perspective`.
pub const APPLY_FAILURES_TOTAL: &str = "vantage_apply_failures_total";
/// Counter: rows completed without re-applying because their work id was cooled, label `perspective`.
pub const COOLDOWN_SKIPS_TOTAL: &str = "vantage_cooldown_skips_total";
/// Counter: lane heads taken over from another (lapsed or dead) holder or from nobody, label `perspective`.
pub const LEASE_TAKEOVERS_TOTAL: &str = "vantage_lease_takeovers_total";
/// Counter: rows given back unstarted, with a refund.
pub const LEASES_RELEASED_TOTAL: &str = "vantage_leases_released_total";
/// Histogram: time to apply one event, label `perspective`.
pub const APPLY_DURATION_SECONDS: &str = "vantage_apply_duration_seconds";
/// Histogram: time of one claim round (orphan claim + stream fetch).
pub const CLAIM_DURATION_SECONDS: &str = "vantage_claim_duration_seconds";
/// Histogram: append → applied, per completed work row, label `perspective`: from the moment
/// its work row was queued (the append's transaction for a new event; a requeue or rebuild for
/// an event queued again) to the commit of its completion, measured on the database's clock up
/// to the claim and on the daemon's after it. Buckets [`APPEND_TO_APPLIED_BUCKETS`]; what
/// `[[slo]]` lag objectives are computed from.
pub const APPEND_TO_APPLIED_SECONDS: &str = "vantage_append_to_applied_seconds";
/// Gauge: work rows waiting (pending + leased + parked), label `perspective`.
pub const BACKLOG_EVENTS: &str = "vantage_backlog_events";
/// Gauge: open (`exhausted`) dead letters, label `perspective`.
pub const DEAD_LETTERS: &str = "vantage_dead_letters";
/// Gauge: age of the oldest waiting work row, label `perspective`.
pub const OLDEST_PENDING_AGE_SECONDS: &str = "vantage_oldest_pending_age_seconds";
/// Gauge: registered, heartbeating instances.
pub const INSTANCES_LIVE: &str = "vantage_instances_live";
/// Gauge: lanes whose head is parked or failing, label `perspective`.
pub const BLOCKED_LANES: &str = "vantage_blocked_lanes";
/// Gauge: events waiting behind a parked or failing lane head, label `perspective`.
pub const BLOCKED_EVENTS: &str = "vantage_blocked_events";
/// Gauge: 1 while the perspective is paused (`vantage perspectives pause`), else 0, label
/// `perspective`.
pub const PERSPECTIVE_PAUSED: &str = "vantage_perspective_paused";
/// Counter: times this instance paused the perspective because its dead letters reached
/// `quarantine_after`, label `perspective`.
pub const PERSPECTIVE_QUARANTINES_TOTAL: &str = "vantage_perspective_quarantines_total";
/// Counter: lanes with work but neither a lane-index row nor a wake-up, found and repaired by
/// this instance's reconciliation (a data-only restore, a mistake), label `perspective`.
pub const LANES_REPAIRED_TOTAL: &str = "vantage_lanes_repaired_total";
/// Gauge (always 1): build information, label `version`.
pub const BUILD_INFO: &str = "vantage_build_info";
/// Gauge: events a version of a versioned perspective has not applied yet (its pending work
/// rows, plus while it backfills the history after its position), labels `perspective` (the
/// configured name) and `version` (docs/versions.md).
pub const PERSPECTIVE_VERSION_BEHIND: &str = "vantage_perspective_version_behind";
/// Gauge: the version readers of a versioned perspective see (0 while none is live), label
/// `perspective`.
pub const PERSPECTIVE_LIVE_VERSION: &str = "vantage_perspective_live_version";
/// Counter: spans the trace exporter sent to the collector (traces on only).
pub const TRACE_SPANS_EXPORTED_TOTAL: &str = "vantage_trace_spans_exported_total";
/// Counter: spans whose export failed (the collector unreachable or refusing them).
pub const TRACE_SPANS_FAILED_TOTAL: &str = "vantage_trace_spans_failed_total";

/// Upper bounds (seconds) of [`APPEND_TO_APPLIED_SECONDS`]: 25 ms to an hour. A lag SLO's
/// threshold must be one of them (an SLO counts the events in its bucket), so they are the
/// round values an objective is written with; the low end resolves the 100 ms target of
/// docs/operations.md ("Performance").
pub const APPEND_TO_APPLIED_BUCKETS: &[f64] = &[
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0, 3600.0,
];

/// Label: perspective name.
pub const LABEL_PERSPECTIVE: &str = "perspective";
/// Label: dead-letter reason.
pub const LABEL_REASON: &str = "reason";
/// Label: build version (of `vantage_build_info`), or a perspective's version.
pub const LABEL_VERSION: &str = "version";

/// Every metric name, for the test that checks dashboards and alerts.
pub const ALL: &[&str] = &[
    DEAD_LETTER_MOVES_TOTAL,
    DEAD_LETTER_MOVE_ERRORS_TOTAL,
    EVENTS_CLAIMED_TOTAL,
    EVENTS_APPLIED_TOTAL,
    APPLY_FAILURES_TOTAL,
    COOLDOWN_SKIPS_TOTAL,
    LEASE_TAKEOVERS_TOTAL,
    LEASES_RELEASED_TOTAL,
    APPLY_DURATION_SECONDS,
    CLAIM_DURATION_SECONDS,
    APPEND_TO_APPLIED_SECONDS,
    BACKLOG_EVENTS,
    DEAD_LETTERS,
    OLDEST_PENDING_AGE_SECONDS,
    INSTANCES_LIVE,
    BLOCKED_LANES,
    BLOCKED_EVENTS,
    PERSPECTIVE_PAUSED,
    PERSPECTIVE_QUARANTINES_TOTAL,
    LANES_REPAIRED_TOTAL,
    BUILD_INFO,
    PERSPECTIVE_VERSION_BEHIND,
    PERSPECTIVE_LIVE_VERSION,
    TRACE_SPANS_EXPORTED_TOTAL,
    TRACE_SPANS_FAILED_TOTAL,
];

/// Registers the help text and unit of every metric in [`ALL`] with the installed recorder
/// (the `# HELP` lines of `/metrics`). Call it after installing the recorder; calling it again
/// is harmless (the first description wins). Units are metadata only: names already carry
/// their unit suffix, so the exporter must not append one.
pub(crate) fn describe_all() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

    describe_counter!(
        DEAD_LETTER_MOVES_TOTAL,
        Unit::Count,
        "Work rows moved to the dead letters, by perspective and reason."
    );
    describe_counter!(
        TRACE_SPANS_EXPORTED_TOTAL,
        Unit::Count,
        "Spans the trace exporter sent to the OTLP collector (traces on only)."
    );
    describe_counter!(
        TRACE_SPANS_FAILED_TOTAL,
        Unit::Count,
        "Spans whose export to the OTLP collector failed (unreachable, or refused)."
    );
    describe_counter!(
        DEAD_LETTER_MOVE_ERRORS_TOTAL,
        Unit::Count,
        "Dead-letter moves that failed with a database error (the row stayed in the apply set)."
    );
    describe_counter!(
        EVENTS_CLAIMED_TOTAL,
        Unit::Count,
        "Work rows claimed, by perspective."
    );
    describe_counter!(
        EVENTS_APPLIED_TOTAL,
        Unit::Count,
        "Events applied and completed, by perspective."
    );
    describe_counter!(
        APPLY_FAILURES_TOTAL,
        Unit::Count,
        "Apply failures recorded, by perspective."
    );
    describe_counter!(
        COOLDOWN_SKIPS_TOTAL,
        Unit::Count,
        "Rows completed without re-applying because their work id was cooled, by perspective."
    );
    describe_counter!(
        LEASE_TAKEOVERS_TOTAL,
        Unit::Count,
        "Lane heads taken over from a lapsed or dead holder or from nobody, by perspective."
    );
    describe_counter!(
        LEASES_RELEASED_TOTAL,
        Unit::Count,
        "Claimed rows given back unstarted, with a refund of their attempt."
    );
    describe_histogram!(
        APPLY_DURATION_SECONDS,
        Unit::Seconds,
        "Time to apply one event, by perspective."
    );
    describe_histogram!(
        CLAIM_DURATION_SECONDS,
        Unit::Seconds,
        "Time of one claim round (orphan claim and stream fetch)."
    );
    describe_histogram!(
        APPEND_TO_APPLIED_SECONDS,
        Unit::Seconds,
        "Append to applied: from the queueing of a work row to the commit of its completion, by perspective."
    );
    describe_gauge!(
        BACKLOG_EVENTS,
        Unit::Count,
        "Work rows waiting (pending, leased and parked), by perspective."
    );
    describe_gauge!(
        DEAD_LETTERS,
        Unit::Count,
        "Open (exhausted) dead letters, by perspective."
    );
    describe_gauge!(
        OLDEST_PENDING_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest waiting work row, by perspective."
    );
    describe_gauge!(
        INSTANCES_LIVE,
        Unit::Count,
        "Registered, heartbeating vantage instances."
    );
    describe_gauge!(
        BLOCKED_LANES,
        Unit::Count,
        "Lanes (stream, perspective) whose head is parked or failing, by perspective."
    );
    describe_gauge!(
        BLOCKED_EVENTS,
        Unit::Count,
        "Events waiting behind a parked or failing lane head, by perspective."
    );
    describe_gauge!(
        PERSPECTIVE_PAUSED,
        "1 while the perspective is paused (vantage perspectives pause), else 0."
    );
    describe_counter!(
        PERSPECTIVE_QUARANTINES_TOTAL,
        Unit::Count,
        "Times this instance paused the perspective because its dead letters reached perspectives.quarantine_after."
    );
    describe_counter!(
        LANES_REPAIRED_TOTAL,
        Unit::Count,
        "Lanes with work that the lane index had lost (no lane row, no wake-up), repaired by reconciliation."
    );
    describe_gauge!(
        BUILD_INFO,
        "Build information (always 1), labelled with the version."
    );
    describe_gauge!(
        PERSPECTIVE_VERSION_BEHIND,
        Unit::Count,
        "Events a version of a versioned perspective has not applied yet, by perspective and version."
    );
    describe_gauge!(
        PERSPECTIVE_LIVE_VERSION,
        "The version readers of a versioned perspective see (0 while none is live), by perspective."
    );
}

/// Exports every counter of these perspectives at 0 (and the unlabelled ones, and the blocked
/// and paused gauges), so `/metrics`
/// shows them before anything happened: dashboards show 0 instead of "No data", and
/// Prometheus's `increase()` sees the first dead-letter move after a start (a series that
/// appears at 1 has no increase).
pub(crate) fn register_zeroes(perspectives: &[String]) {
    use crate::store::{FAILURE_MAX_ATTEMPTS, FAILURE_PERMANENT};
    for p in perspectives {
        for reason in [FAILURE_MAX_ATTEMPTS, FAILURE_PERMANENT] {
            metrics::counter!(DEAD_LETTER_MOVES_TOTAL,
                LABEL_PERSPECTIVE => p.clone(), LABEL_REASON => reason)
            .increment(0);
        }
        for name in [
            EVENTS_CLAIMED_TOTAL,
            EVENTS_APPLIED_TOTAL,
            APPLY_FAILURES_TOTAL,
            COOLDOWN_SKIPS_TOTAL,
            LEASE_TAKEOVERS_TOTAL,
            PERSPECTIVE_QUARANTINES_TOTAL,
            LANES_REPAIRED_TOTAL,
        ] {
            metrics::counter!(name, LABEL_PERSPECTIVE => p.clone()).increment(0);
        }
        // Buckets at 0 from the start, so rate() sees the first late event after a start
        // (a histogram born with it has no increase). Registering is enough.
        let _ = metrics::histogram!(APPEND_TO_APPLIED_SECONDS, LABEL_PERSPECTIVE => p.clone());
        // The sampler sets these; until its first round they read 0, not "No data".
        for name in [BLOCKED_LANES, BLOCKED_EVENTS, PERSPECTIVE_PAUSED] {
            metrics::gauge!(name, LABEL_PERSPECTIVE => p.clone()).set(0.0);
        }
    }
    metrics::counter!(DEAD_LETTER_MOVE_ERRORS_TOTAL).increment(0);
    metrics::counter!(LEASES_RELEASED_TOTAL).increment(0);
}
