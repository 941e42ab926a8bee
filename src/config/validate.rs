//! Rules across keys and bounds that need the whole configuration, checked once on the merged
//! result (by `config check` and every command alike). Bounds on a single value are the
//! parsers' (see [`values`](super::values)).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::error::ConfigError;
use super::limits::{MAX_DURATION_TEXT, MIN_EXTRA_CONNECTIONS};
use super::messages::{quote, Written};
use super::sections::{PerspectiveSettings, Settings, SloKind, SloSettings};
use super::values::Percent;
use crate::connection::check_pg_env;
use crate::statement::Statements;

fn shown(d: Duration) -> String {
    quote(&humantime::format_duration(d).to_string())
}

/// Every rule, in the order of the sections.
pub(super) fn settings(
    s: &Settings,
    w: &Written,
    env: &HashMap<String, String>,
) -> Result<(), ConfigError> {
    let d = &s.database;
    // Zero would make `run` give up before its first attempt could finish (exit 69 against a
    // healthy database): refused rather than read as "try once".
    if d.connect_timeout.is_zero() {
        return Err(w.invalid(
            "database.connect_timeout",
            shown(d.connect_timeout),
            "a duration greater than zero (how long start-up keeps trying to reach the database)",
        ));
    }
    let needed = s.worker.consumers as u64 + MIN_EXTRA_CONNECTIONS;
    if u64::from(d.max_connections) < needed {
        return Err(w.invalid(
            "database.max_connections",
            d.max_connections.to_string(),
            format!(
                "at least {needed} for worker.consumers = {} (a connection for each consumer, one for the work listener and one for the background loops)",
                s.worker.consumers
            ),
        ));
    }
    if let Err((var, value, expected)) = check_pg_env(d.url.as_ref().map(|u| u.expose()), env) {
        return Err(ConfigError::InvalidValue {
            key: var.to_owned(),
            value: quote(&value),
            origin: Some("the environment".to_owned()),
            expected: expected.to_owned(),
        });
    }

    let wk = &s.worker;
    if wk.lease < Duration::from_secs(1) {
        return Err(w.invalid(
            "worker.lease",
            shown(wk.lease),
            format!("a duration of at least 1s and at most {MAX_DURATION_TEXT} (leases are whole seconds in SQL)"),
        ));
    }
    if wk.apply_timeout.is_zero() || wk.apply_timeout >= wk.lease {
        return Err(w.invalid(
            "worker.apply_timeout",
            shown(wk.apply_timeout),
            format!(
                "a duration greater than zero and below worker.lease ({}): an apply must end while its lease is held",
                shown(wk.lease)
            ),
        ));
    }
    // Zero would make the interval timers spin (tokio refuses a zero period).
    if wk.poll_interval.is_zero() {
        return Err(w.invalid(
            "worker.poll_interval",
            shown(wk.poll_interval),
            "a duration greater than zero",
        ));
    }
    if wk.retry_backoff_base > wk.retry_backoff_max {
        return Err(w.invalid(
            "worker.retry_backoff_base",
            shown(wk.retry_backoff_base),
            format!(
                "at most worker.retry_backoff_max ({})",
                shown(wk.retry_backoff_max)
            ),
        ));
    }
    let o = &s.orphans;
    if o.heartbeat_interval.is_zero() {
        return Err(w.invalid(
            "orphans.heartbeat_interval",
            shown(o.heartbeat_interval),
            "a duration greater than zero",
        ));
    }
    if o.stale_after <= o.heartbeat_interval {
        return Err(w.invalid(
            "orphans.stale_after",
            shown(o.stale_after),
            format!(
                "more than orphans.heartbeat_interval ({}), or live instances would be declared dead",
                shown(o.heartbeat_interval)
            ),
        ));
    }
    let c = &s.cooldown;
    if c.enabled && c.max_entries == 0 {
        return Err(w.invalid(
            "cooldown.max_entries",
            "0".to_owned(),
            "a positive integer while cooldown.enabled = true",
        ));
    }
    if c.enabled && c.ttl.is_zero() {
        return Err(w.invalid(
            "cooldown.ttl",
            shown(c.ttl),
            "a duration greater than zero while cooldown.enabled = true",
        ));
    }
    super::console::validate(&s.console, w)?;
    perspectives(&s.perspectives, w)?;
    validate_perspective_statements(&s.perspectives)?;
    slos(&s.slo, w)
}

/// The `[[slo]]` entries (docs/operations.md, "SLOs and alerts"): exactly one kind each, a lag
/// the histogram has a bucket for, a budget the alerts can detect, and names that keep the
/// rules' series apart.
fn slos(list: &[SloSettings], w: &Written) -> Result<(), ConfigError> {
    use crate::telemetry::metrics::APPEND_TO_APPLIED_BUCKETS;
    for (i, slo) in list.iter().enumerate() {
        let at = |field: &str| format!("slo[{i}].{field}");
        let p = &slo.perspective;
        if p.trim().is_empty() || p.chars().any(char::is_control) {
            return Err(w.invalid(
                &at("perspective"),
                quote(p),
                "a perspective's name (non-empty, no control characters), or \"*\" for each",
            ));
        }
        if let Some(name) = &slo.name {
            // It is a label value, and alert labels are templates: plain characters only.
            let plain = !name.is_empty()
                && name.len() <= 63
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-.%".contains(c));
            if !plain {
                return Err(w.invalid(
                    &at("name"),
                    quote(name),
                    "1 to 63 letters, digits, _, -, . or %",
                ));
            }
        }
        match (slo.lag, slo.dead_letter_rate) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(ConfigError::Invalid {
                    key: format!("slo[{i}]"),
                    message: "give exactly one of lag (a lag SLO: lag = \"30s\") and \
                              dead_letter_rate (a dead-letter-rate SLO: dead_letter_rate = \"0.1%\")"
                        .to_owned(),
                })
            }
            (None, Some(_)) if slo.objective.is_some() => {
                return Err(ConfigError::Invalid {
                    key: at("objective"),
                    message: "a dead-letter-rate SLO has no objective: its dead_letter_rate is \
                              the error budget (dead_letter_rate = \"0.1%\" is 99.9% of events \
                              not dead-lettered)"
                        .to_owned(),
                })
            }
            _ => {}
        }
        let budget_key = match slo.kind() {
            SloKind::Lag { lag, .. } => {
                let seconds = lag.as_secs_f64();
                if !APPEND_TO_APPLIED_BUCKETS.contains(&seconds) {
                    let bounds: Vec<String> = APPEND_TO_APPLIED_BUCKETS
                        .iter()
                        .map(|b| {
                            humantime::format_duration(Duration::from_secs_f64(*b)).to_string()
                        })
                        .collect();
                    return Err(w.invalid(
                        &at("lag"),
                        shown(lag),
                        format!(
                            "one of {} (the bounds of the append-to-applied histogram the SLO is \
                             computed from)",
                            bounds.join(", ")
                        ),
                    ));
                }
                "objective"
            }
            SloKind::DeadLetterRate(_) => "dead_letter_rate",
        };
        let budget = slo.budget();
        // The fast page fires at the highest burn rate; a budget so large that even every event
        // failing stays below it could never fire. (0 would make every miss an outage.)
        let burn = crate::telemetry::slo::fastest_burn(slo.window);
        let highest = u64::from(Percent::WHOLE) * crate::telemetry::slo::BURN_SCALE / burn;
        if budget.ppm() == 0 || u64::from(budget.ppm()) >= highest {
            let value = match slo.kind() {
                SloKind::Lag { objective, .. } => objective,
                SloKind::DeadLetterRate(rate) => rate,
            };
            let limit = Percent::from_ppm(highest.min(u64::from(Percent::WHOLE)) as u32);
            let expected = match slo.kind() {
                SloKind::Lag { .. } => format!(
                    "below 100% and above {} over a window of {} (its fastest alert fires at {}x \
                     the budget's burn rate, which a larger budget could never reach)",
                    limit.complement(),
                    crate::telemetry::slo::window_text(slo.window),
                    crate::config::decimal(burn, 4)
                ),
                SloKind::DeadLetterRate(_) => format!(
                    "above 0% and below {limit} over a window of {} (its fastest alert fires at \
                     {}x the budget's burn rate, which a larger budget could never reach)",
                    crate::telemetry::slo::window_text(slo.window),
                    crate::config::decimal(burn, 4)
                ),
            };
            return Err(w.invalid(&at(budget_key), quote(&value.to_string()), expected));
        }
    }
    // The rules' series are told apart by (slo name, perspective): two entries may share a name
    // only when no perspective is covered by both.
    for (i, a) in list.iter().enumerate() {
        for (j, b) in list.iter().enumerate().take(i) {
            if a.name() != b.name() {
                continue;
            }
            let same_kind = std::mem::discriminant(&a.kind()) == std::mem::discriminant(&b.kind());
            let overlap = a.perspective == b.perspective
                || ((a.is_every_perspective() || b.is_every_perspective()) && !same_kind);
            if overlap {
                return Err(ConfigError::Invalid {
                    key: format!("slo[{i}].name"),
                    message: format!(
                        "slo[{i}] and slo[{j}] are both named '{}' and cover the same perspective: \
                         give one a name of its own",
                        a.name()
                    ),
                });
            }
        }
    }
    Ok(())
}

fn perspectives(list: &[PerspectiveSettings], w: &Written) -> Result<(), ConfigError> {
    let mut names: HashMap<&str, usize> = HashMap::new();
    for (i, p) in list.iter().enumerate() {
        let at = |field: &str| format!("perspectives[{i}].{field}");
        if p.name.trim().is_empty() {
            return Err(w.invalid(&at("name"), quote(&p.name), "a non-empty name"));
        }
        // The name is a label in logs, metrics and tables: a control character would garble
        // them (or forge a line).
        if p.name.chars().any(char::is_control) {
            return Err(w.invalid(
                &at("name"),
                quote(&p.name),
                "a name without control characters",
            ));
        }
        if let Some(first) = names.insert(&p.name, i) {
            return Err(w.invalid(
                &at("name"),
                quote(&p.name),
                format!("a name not used by another perspective (perspectives[{first}] has it)"),
            ));
        }
        if p.events.is_empty() {
            return Err(ConfigError::Invalid {
                key: at("events"),
                message: format!("perspective '{}' subscribes to no event type", p.name),
            });
        }
        let mut seen = HashSet::new();
        for event_type in &p.events {
            if event_type.trim().is_empty() || !seen.insert(event_type.as_str()) {
                let mut e = w.invalid(
                    &at("events"),
                    String::new(),
                    "distinct, non-empty event types",
                );
                if let ConfigError::InvalidValue { value, .. } = &mut e {
                    *value = quote(event_type);
                }
                return Err(e);
            }
        }
        let wildcard = p.events.iter().any(|e| e == "*");
        for (event_type, statement) in &p.sql {
            let key = format!("perspectives[{i}].sql.{event_type}");
            if !wildcard && !p.events.contains(event_type) {
                return Err(ConfigError::Invalid {
                    key,
                    message: format!(
                        "perspective '{}' has a statement for event type '{event_type}', which is not listed in its events",
                        p.name
                    ),
                });
            }
            if statement.trim().is_empty() {
                return Err(ConfigError::Invalid {
                    key,
                    message: "the statement is empty".to_owned(),
                });
            }
        }
        if !wildcard {
            if let Some(event_type) = p.events.iter().find(|e| !p.sql.contains_key(*e)) {
                return Err(ConfigError::Invalid {
                    key: at("sql"),
                    message: format!(
                        "perspective '{}' lists event type '{event_type}' but has no statement for it",
                        p.name
                    ),
                });
            }
        }
        if p.reset.as_deref().is_some_and(|r| r.trim().is_empty()) {
            return Err(ConfigError::Invalid {
                key: at("reset"),
                message: "the statement is empty".to_owned(),
            });
        }
        versioning(p, &at, w)?;
    }
    Ok(())
}

/// The keys of a versioned perspective (docs/versions.md): all of `read_schema`, `tables` and
/// `setup`, or none of them (and `version` 1). Names become schema and view names, so they are
/// plain lower-case identifiers, short enough for `NAME_vN` to fit PostgreSQL's 63 bytes.
fn versioning(
    p: &PerspectiveSettings,
    at: &dyn Fn(&str) -> String,
    w: &Written,
) -> Result<(), ConfigError> {
    let Some(read_schema) = &p.read_schema else {
        for (key, set) in [
            ("version", p.version != 1),
            ("tables", !p.tables.is_empty()),
            ("setup", p.setup.is_some()),
        ] {
            if set {
                return Err(ConfigError::Invalid {
                    key: at(key),
                    message: format!(
                        "perspective '{}' sets {key} but no read_schema: only a versioned perspective has versions, tables and setup",
                        p.name
                    ),
                });
            }
        }
        return Ok(());
    };
    let identifier = |s: &str, max: usize| {
        s.len() <= max
            && s.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    const IDENTIFIER: &str = "a lower-case identifier (a-z, 0-9, _; not starting with a digit)";
    if !identifier(&p.name, 50) {
        return Err(w.invalid(
            &at("name"),
            quote(&p.name),
            format!("{IDENTIFIER} of at most 50 bytes: a versioned perspective's name names its schemas"),
        ));
    }
    if !identifier(read_schema, 63) {
        return Err(w.invalid(&at("read_schema"), quote(read_schema), IDENTIFIER));
    }
    if p.tables.is_empty() {
        return Err(ConfigError::Invalid {
            key: at("tables"),
            message: format!(
                "versioned perspective '{}' lists no tables: name the tables its setup creates",
                p.name
            ),
        });
    }
    let mut seen = HashSet::new();
    for t in &p.tables {
        if !identifier(t, 63) || !seen.insert(t.as_str()) {
            return Err(w.invalid(
                &at("tables"),
                quote(t),
                format!("distinct table names, each {IDENTIFIER}"),
            ));
        }
    }
    if !p.setup.as_deref().is_some_and(|s| !s.trim().is_empty()) {
        return Err(ConfigError::Invalid {
            key: at("setup"),
            message: format!(
                "versioned perspective '{}' has no setup: give the SQL that creates its tables",
                p.name
            ),
        });
    }
    if p.reset.is_some() {
        return Err(ConfigError::Invalid {
            key: at("reset"),
            message: format!(
                "versioned perspective '{}' has a reset: a versioned perspective is rebuilt by bumping its version, not reset",
                p.name
            ),
        });
    }
    Ok(())
}

/// What can be refused about SQL perspective statements without a database (the rules are the
/// crate's `statement` module, which the SQL perspective applies too): a subscribed type with
/// no statement to run (`"*"` needs a `"*"` statement), a parameter beyond `$7` (or any in
/// `reset`), a statement that ends or controls the transaction. The daemon checks again after
/// preparing, with PostgreSQL's own parameter count.
pub(super) fn validate_perspective_statements(
    perspectives: &[PerspectiveSettings],
) -> Result<(), ConfigError> {
    for (i, p) in perspectives.iter().enumerate() {
        Statements {
            name: &p.name,
            events: &p.events,
            sql: &p.sql,
            reset: p.reset.as_deref(),
        }
        .check(true)
        .map_err(|e| ConfigError::Invalid {
            key: format!("perspectives[{i}].{}", e.key),
            message: e.to_string(),
        })?;
    }
    Ok(())
}
