//! `[[slo]]` → Prometheus rules: what `vantage alerts render` prints (docs/operations.md, "SLOs
//! and alerts").
//!
//! Each SLO becomes one rule group: recording rules of its error ratio over 5m, 30m, 1h, 6h
//! and 3d (`vantage:slo_error_ratio:rate5m` …, labelled `slo` and `perspective`), then the
//! multi-window, multi-burn-rate alerts of the SRE workbook (chapter 5, "Alerting on SLOs"):
//! each fires while the error ratio is above `burn × budget` over a long window *and* a short
//! one (the short one makes it resolve minutes after the burn stops):
//!
//! | alert         | budget spent      | long / short | burn at 30d | severity |
//! |---------------|-------------------|--------------|-------------|----------|
//! | `…FastBurn`   | 2 % in an hour    | 1h / 5m      | 14.4        | critical |
//! | `…SlowBurn`   | 5 % in six hours  | 6h / 30m     | 6           | critical |
//! | `…SteadyBurn` | 10 % in three days| 3d / 6h      | 1           | warning  |
//!
//! The burn rates follow the SLO's window (`burn = share of budget × window / long window`),
//! kept exact in units of [`BURN_SCALE`]. The output is a pure function of the SLOs, so the
//! shipped `deploy/prometheus/vantage-slo.yaml` can be compared with it byte for byte.

use std::fmt::Write as _;
use std::time::Duration;

use super::metrics as m;
use crate::config::{SloKind, SloSettings};

/// Burn rates are integers in units of 1/10 000.
pub const BURN_SCALE: u64 = 10_000;

/// The windows the error ratio is recorded over, as PromQL spells them, and their length.
const WINDOWS: [(&str, u64); 5] = [
    ("5m", 5 * 60),
    ("30m", 30 * 60),
    ("1h", 3600),
    ("6h", 6 * 3600),
    ("3d", 3 * 86_400),
];

/// One pair of windows of the workbook's table.
struct Pair {
    /// `VantageLagSLO<suffix>` / `VantageDeadLetterSLO<suffix>`.
    suffix: &'static str,
    long: &'static str,
    short: &'static str,
    long_hours: u64,
    /// Share of the budget it fires at, in units of 1/10 000 (200 = 2 %).
    spent: u64,
    severity: &'static str,
}

const PAIRS: [Pair; 3] = [
    Pair {
        suffix: "FastBurn",
        long: "1h",
        short: "5m",
        long_hours: 1,
        spent: 200,
        severity: "critical",
    },
    Pair {
        suffix: "SlowBurn",
        long: "6h",
        short: "30m",
        long_hours: 6,
        spent: 500,
        severity: "critical",
    },
    Pair {
        suffix: "SteadyBurn",
        long: "3d",
        short: "6h",
        long_hours: 72,
        spent: 1000,
        severity: "warning",
    },
];

/// The recording rule of the error ratio over `window` (`5m`, `1h`, …).
pub fn error_ratio_record(window: &str) -> String {
    format!("vantage:slo_error_ratio:rate{window}")
}

fn burn(pair: &Pair, window: Duration) -> u64 {
    pair.spent * (window.as_secs() / 3600) / pair.long_hours
}

/// The highest burn rate an SLO with this window alerts at (the fast page's), in units of
/// [`BURN_SCALE`]: 144 000 (14.4) for 30 days.
pub fn fastest_burn(window: Duration) -> u64 {
    PAIRS
        .iter()
        .map(|p| burn(p, window))
        .max()
        .unwrap_or(1)
        .max(1)
}

/// The rule file for `slos`, or for [`SloSettings::defaults`] when `slos` is empty.
pub fn render(slos: &[SloSettings]) -> String {
    let defaults;
    let (slos, origin) = if slos.is_empty() {
        defaults = SloSettings::defaults();
        (
            defaults.as_slice(),
            "no [[slo]] is configured, so these are the defaults",
        )
    } else {
        (slos, "from the [[slo]] entries of the configuration")
    };
    let mut out = String::new();
    out.push_str(
        "# Prometheus rules for vantage's service-level objectives, printed by `vantage alerts render`\n",
    );
    let _ = writeln!(
        out,
        "# ({origin}). Do not edit: change the [[slo]] entries and render again."
    );
    out.push_str("# Check with: promtool check rules FILE. With the Prometheus Operator, put the `groups:`\n");
    out.push_str("# below under `spec:` of a PrometheusRule. docs/operations.md, \"SLOs and alerts\", says\n");
    out.push_str("# what fires when and what to do.\n#\n");
    for slo in slos {
        let _ = writeln!(out, "# - {}", describe(slo));
    }
    out.push_str("groups:\n");
    for slo in slos {
        group(&mut out, slo, slos);
    }
    out
}

/// `lag-30s: perspective "*", 99.9% of events applied within 30s of their append, over 30d`.
fn describe(slo: &SloSettings) -> String {
    let who = if slo.is_every_perspective() {
        "each perspective".to_owned()
    } else {
        format!("perspective {}", json(&slo.perspective))
    };
    let what = match slo.kind() {
        SloKind::Lag { lag, objective } => format!(
            "{objective} of events applied within {} of their append",
            humantime::format_duration(lag)
        ),
        SloKind::DeadLetterRate(rate) => format!("at most {rate} of events dead-lettered"),
    };
    format!(
        "{}: {who}, {what}, over {}",
        slo.name(),
        window_text(slo.window)
    )
}

fn same_kind(a: &SloSettings, b: &SloSettings) -> bool {
    std::mem::discriminant(&a.kind()) == std::mem::discriminant(&b.kind())
}

/// The perspective matcher of an SLO: its perspective, or for `"*"` every perspective except
/// those with an SLO of the same kind of their own (empty when there is none).
fn perspective_matcher(slo: &SloSettings, all: &[SloSettings]) -> Option<String> {
    if !slo.is_every_perspective() {
        return Some(format!(
            "{}={}",
            m::LABEL_PERSPECTIVE,
            promql_string(&slo.perspective)
        ));
    }
    let mut own: Vec<&str> = all
        .iter()
        .filter(|o| !o.is_every_perspective() && same_kind(o, slo))
        .map(|o| o.perspective.as_str())
        .collect();
    own.sort_unstable();
    own.dedup();
    if own.is_empty() {
        return None;
    }
    let alternatives: Vec<String> = own.iter().map(|p| regex_escape(p)).collect();
    Some(format!(
        "{}!~{}",
        m::LABEL_PERSPECTIVE,
        promql_string(&alternatives.join("|"))
    ))
}

/// `metric{a,b}`, or `metric` when there is no matcher.
fn series(metric: &str, matchers: &[&str]) -> String {
    let matchers: Vec<&str> = matchers.iter().copied().filter(|m| !m.is_empty()).collect();
    if matchers.is_empty() {
        metric.to_owned()
    } else {
        format!("{metric}{{{}}}", matchers.join(","))
    }
}

/// The bucket of `seconds`. Prometheus 3 rewrites whole numbers as `30.0` when it scrapes
/// (the daemon writes `30`), so those match both spellings.
fn le_matcher(seconds: f64) -> String {
    let written = seconds.to_string();
    if seconds.fract() == 0.0 {
        format!("le=~{}", promql_string(&format!("{written}|{written}\\.0")))
    } else {
        format!("le={}", promql_string(&written))
    }
}

/// The error ratio of `slo` over `window` (PromQL, indented for a block scalar).
fn error_ratio(slo: &SloSettings, selector: &str, window: &str, indent: &str) -> String {
    let by = format!("sum by ({})", m::LABEL_PERSPECTIVE);
    match slo.kind() {
        SloKind::Lag { lag, .. } => {
            let le = le_matcher(lag.as_secs_f64());
            let bucket = series(
                &format!("{}_bucket", m::APPEND_TO_APPLIED_SECONDS),
                &[selector, &le],
            );
            let count = series(
                &format!("{}_count", m::APPEND_TO_APPLIED_SECONDS),
                &[selector],
            );
            format!(
                "{indent}1 - (\n\
                 {indent}  {by} (rate({bucket}[{window}]))\n\
                 {indent}  /\n\
                 {indent}  {by} (rate({count}[{window}]))\n\
                 {indent})\n"
            )
        }
        SloKind::DeadLetterRate(_) => {
            let moved = format!(
                "{by} (rate({}[{window}]))",
                series(m::DEAD_LETTER_MOVES_TOTAL, &[selector])
            );
            let applied = format!(
                "{by} (rate({}[{window}]))",
                series(m::EVENTS_APPLIED_TOTAL, &[selector])
            );
            format!(
                "{indent}{moved}\n\
                 {indent}/\n\
                 {indent}(\n\
                 {indent}  {moved}\n\
                 {indent}  +\n\
                 {indent}  {applied}\n\
                 {indent})\n"
            )
        }
    }
}

fn group(out: &mut String, slo: &SloSettings, all: &[SloSettings]) {
    let name = slo.name();
    let selector = perspective_matcher(slo, all).unwrap_or_default();
    let _ = writeln!(
        out,
        "  - name: {}",
        json(&format!("vantage-slo/{}/{name}", slo.perspective))
    );
    out.push_str("    rules:\n");
    for (window, _) in WINDOWS {
        let _ = writeln!(out, "      - record: {}", error_ratio_record(window));
        out.push_str("        expr: |\n");
        out.push_str(&error_ratio(slo, &selector, window, "          "));
        out.push_str("        labels:\n");
        let _ = writeln!(out, "          slo: {}", json(&name));
    }
    let budget = slo.budget();
    let kind = match slo.kind() {
        SloKind::Lag { .. } => "Lag",
        SloKind::DeadLetterRate(_) => "DeadLetter",
    };
    let own = format!("slo={}", promql_string(&name));
    for pair in &PAIRS {
        let burn = burn(pair, slo.window);
        let threshold = format!("({} * {})", crate::config::decimal(burn, 4), budget.ratio());
        let _ = writeln!(out, "      - alert: Vantage{kind}SLO{}", pair.suffix);
        out.push_str("        expr: |\n");
        for (i, window) in [pair.long, pair.short].into_iter().enumerate() {
            if i > 0 {
                out.push_str("          and\n");
            }
            let _ = writeln!(
                out,
                "          {} > {threshold}",
                series(&error_ratio_record(window), &[&own, &selector])
            );
        }
        out.push_str("        labels:\n");
        let _ = writeln!(out, "          severity: {}", pair.severity);
        out.push_str("        annotations:\n");
        let (summary, description) = annotations(slo, pair, burn);
        let _ = writeln!(out, "          summary: {}", json(&summary));
        out.push_str("          description: >-\n");
        for line in wrap(&description, 88) {
            let _ = writeln!(out, "            {line}");
        }
    }
}

/// What an alert tells the operator: what is late or lost, how fast the budget goes, and the
/// commands to find out why.
fn annotations(slo: &SloSettings, pair: &Pair, burn: u64) -> (String, String) {
    const P: &str = "{{ $labels.perspective }}";
    const VALUE: &str = "{{ $value | humanizePercentage }}";
    let name = slo.name();
    let window = window_text(slo.window);
    let budget = slo.budget();
    let spent = if burn <= BURN_SCALE {
        format!("at this rate the {window} error budget is spent within the window")
    } else {
        format!(
            "at this rate the whole {window} error budget is spent in {}",
            exhaustion(slo.window, burn)
        )
    };
    let over = format!("over the last {} (and the last {})", pair.long, pair.short);
    match slo.kind() {
        SloKind::Lag { lag, objective } => {
            let lag = humantime::format_duration(lag);
            (
                format!("Perspective {P} applies events too late for SLO {name}"),
                format!(
                    "{VALUE} of the events of perspective {P} took longer than {lag} from append \
                     to applied {over}; SLO {name} allows {budget} ({objective} within {lag} over \
                     {window}): {spent}. Find what holds it back: `vantage status` (backlog, \
                     oldest pending, a pause), `vantage status --blocked --perspective {P}` \
                     (events waiting behind a failing one) and the dashboard's throughput and \
                     apply latency; if it is simply more work than it keeps up with, add \
                     consumers (worker.consumers) or instances."
                ),
            )
        }
        SloKind::DeadLetterRate(_) => (
            format!("Perspective {P} dead-letters too many events for SLO {name}"),
            format!(
                "{VALUE} of the events of perspective {P} that ended {over} were dead-lettered; \
                 SLO {name} allows {budget} over {window}: {spent}. See what fails with \
                 `vantage dlq groups --perspective {P}` and `vantage dlq inspect POSITION`; if a \
                 handler is broken, `vantage perspectives pause {P}` stops the loss while you fix \
                 it, and `vantage dlq requeue --group FINGERPRINT` hands the events back after."
            ),
        ),
    }
}

/// An SLO window as written: `30d`, or `36h` when it is not whole days.
pub(crate) fn window_text(window: Duration) -> String {
    let secs = window.as_secs();
    if secs % 86_400 == 0 {
        format!("{}d", secs / 86_400)
    } else {
        format!("{}h", secs / 3600)
    }
}

/// How long a budget of `window` lasts at `burn`: `2 days`, `20 hours`.
fn exhaustion(window: Duration, burn: u64) -> String {
    let hours = (window.as_secs() / 3600) * BURN_SCALE / burn;
    if hours >= 48 {
        format!("{} days", (hours + 12) / 24)
    } else {
        format!("{} hours", hours.max(1))
    }
}

/// `text` in lines of at most `width` characters (words are never split).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// A YAML double-quoted scalar (JSON's string syntax is YAML's).
fn json(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serializes")
}

/// A PromQL string literal (Go's escapes: `\\`, `\"`).
fn promql_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            _ => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `s` matched literally by an RE2 regular expression.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    fn slos(toml: &str) -> Vec<SloSettings> {
        Settings::from_toml_str(toml).expect("valid").slo
    }

    #[test]
    fn burn_rates_follow_the_workbook_at_thirty_days_and_scale_with_the_window() {
        let days = |d: u64| Duration::from_secs(d * 86_400);
        let at = |d| PAIRS.iter().map(|p| burn(p, days(d))).collect::<Vec<_>>();
        assert_eq!(at(30), [144_000, 60_000, 10_000]);
        assert_eq!(at(7), [33_600, 14_000, 2_333]);
        assert_eq!(fastest_burn(days(30)), 144_000);
        assert_eq!(exhaustion(days(30), 144_000), "2 days");
        assert_eq!(exhaustion(days(30), 60_000), "5 days");
        assert_eq!(exhaustion(days(3), 14_400), "2 days");
        assert_eq!(exhaustion(days(3), 60_000), "12 hours");
    }

    #[test]
    fn no_slo_renders_the_defaults_and_the_output_is_deterministic() {
        let rendered = render(&[]);
        assert_eq!(
            rendered,
            render(&SloSettings::defaults()).replace(
                "from the [[slo]] entries of the configuration",
                "no [[slo]] is configured, so these are the defaults"
            )
        );
        assert_eq!(rendered, render(&[]));
        assert!(rendered.contains("# - lag-30s: each perspective, 99.9% of events applied within 30s of their append, over 30d"), "{rendered}");
        assert!(rendered.contains("# - dead-letters-0.1%: each perspective, at most 0.1% of events dead-lettered, over 30d"));
        for alert in [
            "VantageLagSLOFastBurn",
            "VantageLagSLOSlowBurn",
            "VantageLagSLOSteadyBurn",
            "VantageDeadLetterSLOFastBurn",
            "VantageDeadLetterSLOSlowBurn",
            "VantageDeadLetterSLOSteadyBurn",
        ] {
            assert_eq!(
                rendered.matches(&format!("- alert: {alert}\n")).count(),
                1,
                "{alert}"
            );
        }
        assert!(rendered.contains(
            "          vantage:slo_error_ratio:rate1h{slo=\"lag-30s\"} > (14.4 * 0.001)\n          and\n          vantage:slo_error_ratio:rate5m{slo=\"lag-30s\"} > (14.4 * 0.001)\n"
        ), "{rendered}");
        assert!(
            rendered.contains(
                "rate(vantage_append_to_applied_seconds_bucket{le=~\"30|30\\\\.0\"}[5m])"
            ),
            "{rendered}"
        );
        assert!(rendered
            .contains("vantage:slo_error_ratio:rate3d{slo=\"dead-letters-0.1%\"} > (1 * 0.001)"));
        // Valid YAML, with the shape promtool expects.
        let parsed: serde_json::Value = serde_yaml_ng::from_str(&rendered).expect("YAML");
        let groups = parsed["groups"].as_array().unwrap();
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[0]["name"], "vantage-slo/*/lag-30s");
        assert_eq!(groups[0]["rules"].as_array().unwrap().len(), 5 + 3);
    }

    #[test]
    fn a_perspective_of_its_own_leaves_the_wildcard_of_its_kind() {
        let rendered = render(&slos(
            r#"
            [[slo]]
            lag = "30s"
            [[slo]]
            perspective = "or.ders"
            lag = "5s"
            objective = "99%"
            window = "7d"
            [[slo]]
            perspective = "billing"
            dead_letter_rate = "1%"
            "#,
        ));
        // The wildcard lag SLO leaves out the perspective with a lag SLO of its own (escaped
        // for the regex, then for the string), but not the one with only a dead-letter SLO.
        assert!(rendered.contains(
            "vantage_append_to_applied_seconds_bucket{perspective!~\"or\\\\.ders\",le=~\"30|30\\\\.0\"}[1h]"
        ), "{rendered}");
        assert!(rendered.contains(
            "vantage:slo_error_ratio:rate1h{slo=\"lag-5s\",perspective=\"or.ders\"} > (3.36 * 0.01)"
        ), "{rendered}");
        assert!(rendered.contains("vantage_append_to_applied_seconds_bucket{perspective=\"or.ders\",le=~\"5|5\\\\.0\"}[6h]"));
        assert!(rendered
            .contains("rate(vantage_dead_letter_moves_total{perspective=\"billing\"}[30m])"));
        assert!(rendered.contains("  - name: \"vantage-slo/billing/dead-letters-1%\"\n"));
        let words = rendered.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            words.contains("the whole 7d error budget is spent in 2 days"),
            "{rendered}"
        );
        serde_yaml_ng::from_str::<serde_json::Value>(&rendered).expect("YAML");
    }

    #[test]
    fn names_in_promql_are_escaped() {
        assert_eq!(promql_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(regex_escape("a.b|c(d)"), r"a\.b\|c\(d\)");
        assert_eq!(le_matcher(0.25), "le=\"0.25\"");
        assert_eq!(le_matcher(30.0), "le=~\"30|30\\\\.0\"");
        assert_eq!(wrap("aa bb cc", 5), ["aa bb", "cc"]);
    }
}
