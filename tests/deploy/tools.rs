//! The deploy kit checked by the tools operators run on it: `promtool check rules`, `promtool
//! check config` and `promtool test rules` on the Prometheus files; `systemd-analyze verify` and
//! `systemd-analyze security` on the systemd unit (in a temporary root where the binary it names
//! exists), with the unit's values read by an INI parser and its time spans by systemd itself.
//!
//! The tools come from Debian's `prometheus` and `systemd` packages (`.ci/run` installs them);
//! a missing tool fails the test with the package to install, it never skips.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use ini::{Ini, ParseOption, Properties};
use vantage::config::{ConfigError, Settings};

use crate::support::deploy::{self, output_text, run_with_limit, tool};

/// Generous: only a hang should reach it.
const TOOL_LIMIT: Duration = Duration::from_secs(60);

/// What the daemon may take beyond `worker.shutdown_grace` to stop (releasing leases,
/// deregistering, closing the pool: about 10 s in the worst case), plus a margin.
const SHUTDOWN_OVERHEAD: Duration = Duration::from_secs(15);

fn promtool() -> Command {
    Command::new(tool("promtool", "prometheus"))
}

fn systemd_analyze() -> Command {
    Command::new(tool("systemd-analyze", "systemd"))
}

// ---------------------------------------------------------------------------------------------
// Prometheus

#[test]
fn promtool_accepts_the_alert_rules() {
    for file in ["vantage-alerts.yaml", "vantage-slo.yaml"] {
        promtool_accepts(file);
    }
}

fn promtool_accepts(file: &str) {
    let rel = format!("prometheus/{file}");
    let rules = deploy::deploy_path(&rel);
    let out = run_with_limit(promtool().arg("check").arg("rules").arg(&rules), TOOL_LIMIT);
    assert!(
        out.status.success(),
        "promtool check rules: {}",
        output_text(&out)
    );
    let parsed = deploy::yaml_deploy(&rel);
    let count = deploy::prometheus_rules(&parsed).len();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("SUCCESS: {count} rules found")),
        "promtool should find the file's {count} rules: {}",
        output_text(&out)
    );
    // promtool also lints: no warnings either (it prints them on stderr, exit 0).
    assert!(
        out.stderr.is_empty(),
        "promtool warns about the rules: {}",
        output_text(&out)
    );
}

#[test]
fn promtool_accepts_the_example_scrape_config_and_its_rule_file() {
    let config = deploy::deploy_path("prometheus/prometheus.example.yaml");
    let out = run_with_limit(
        promtool().arg("check").arg("config").arg(&config),
        TOOL_LIMIT,
    );
    assert!(
        out.status.success(),
        "promtool check config: {}",
        output_text(&out)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The rule file it names is found (relative to the config file) and checked too.
    for file in ["vantage-alerts.yaml", "vantage-slo.yaml"] {
        assert!(
            stdout.contains(file) && stdout.contains("rules found"),
            "promtool check config should load {file}: {}",
            output_text(&out)
        );
    }
}

#[test]
fn promtool_unit_tests_of_the_alerts_pass_with_the_shipped_durations() {
    // deploy/prometheus/vantage-alerts.test.yaml: synthetic series over hours, against the
    // shipped `for:` durations and thresholds (the live test in prometheus.rs shortens
    // `for:`; this one does not). vantage-slo.test.yaml: each SLO alert fires under a burn,
    // resolves after it, and stays quiet below its burn rate.
    for (tests, rules) in [
        ("vantage-alerts.test.yaml", "vantage-alerts.yaml"),
        ("vantage-slo.test.yaml", "vantage-slo.yaml"),
    ] {
        promtool_unit_tests_pass(tests, rules);
    }
}

fn promtool_unit_tests_pass(tests_file: &str, rules_file: &str) {
    let tests = deploy::deploy_path(&format!("prometheus/{tests_file}"));
    let out = run_with_limit(
        promtool()
            .arg("test")
            .arg("rules")
            .arg(&tests)
            .current_dir(tests.parent().unwrap()),
        TOOL_LIMIT,
    );
    assert!(
        out.status.success(),
        "promtool test rules: {}",
        output_text(&out)
    );
    let parsed = deploy::yaml_deploy(&format!("prometheus/{tests_file}"));
    let tested: std::collections::BTreeSet<&str> =
        deploy::seq_at(&parsed, "alerts test", &["tests"])
            .iter()
            .flat_map(|t| t.get("alert_rule_test").and_then(|a| a.as_sequence()))
            .flatten()
            .filter_map(|a| a.get("alertname").and_then(|n| n.as_str()))
            .collect();
    let rules = deploy::yaml_deploy(&format!("prometheus/{rules_file}"));
    let mut alerts = 0;
    for rule in deploy::prometheus_rules(&rules) {
        let Some(name) = rule.get("alert").and_then(|a| a.as_str()) else {
            continue; // a recording rule: the alerts test what it records
        };
        alerts += 1;
        assert!(
            tested.contains(name),
            "{tests_file} has no alert_rule_test for {name}"
        );
    }
    assert!(alerts > 0, "{rules_file} has no alert");
}

/// The shipped SLO rules are `vantage alerts render` of the default SLOs (no `[[slo]]`), byte
/// for byte, so they never drift from the code. `UPDATE_GOLDEN=1` rewrites the file.
#[test]
fn the_shipped_slo_rules_are_the_rendered_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_with_limit(
        Command::new(crate::support::process::BIN)
            .args(["alerts", "render"])
            .current_dir(dir.path())
            .env_clear(),
        TOOL_LIMIT,
    );
    assert!(
        out.status.success(),
        "vantage alerts render: {}",
        output_text(&out)
    );
    assert!(out.stderr.is_empty(), "{}", output_text(&out));
    let rendered = String::from_utf8(out.stdout).expect("UTF-8");
    let path = deploy::deploy_path("prometheus/vantage-slo.yaml");
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &rendered).unwrap();
    }
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        rendered,
        "deploy/prometheus/vantage-slo.yaml is not what `vantage alerts render` prints for the \
         default SLOs; rerun with UPDATE_GOLDEN=1 (and the promtool tests) after changing them"
    );
}

// ---------------------------------------------------------------------------------------------
// systemd

/// The shipped unit, parsed as INI (`#` comments, `Key=value`, repeated keys kept).
fn unit() -> Ini {
    Ini::load_from_str_opt(
        &deploy::read_deploy("systemd/vantage.service"),
        ParseOption {
            enabled_quote: false,
            enabled_escape: false,
            ..ParseOption::default()
        },
    )
    .expect("vantage.service parses as INI")
}

fn section<'a>(unit: &'a Ini, name: &str) -> &'a Properties {
    unit.section(Some(name))
        .unwrap_or_else(|| panic!("vantage.service has no [{name}] section"))
}

/// The one value of `key`.
#[track_caller]
fn value<'a>(props: &'a Properties, key: &str) -> &'a str {
    let all: Vec<&str> = props.get_all(key).collect();
    match all.as_slice() {
        [one] => one,
        [] => panic!("vantage.service does not set {key}="),
        many => panic!("vantage.service sets {key}= {} times: {many:?}", many.len()),
    }
}

/// A time span as systemd reads it (`systemd-analyze timespan`).
fn systemd_timespan(span: &str) -> Duration {
    let out = run_with_limit(systemd_analyze().arg("timespan").arg(span), TOOL_LIMIT);
    assert!(
        out.status.success(),
        "systemd rejects the time span {span:?}: {}",
        output_text(&out)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let micros: u64 = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("μs:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `μs:` line in systemd-analyze timespan: {stdout}"));
    Duration::from_micros(micros)
}

/// A root directory with the system's own units (sysinit.target & co.), the shipped unit in
/// /etc/systemd/system and an executable where its ExecStart= points.
fn unit_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("temp dir");
    let units = root.path().join("usr/lib/systemd");
    std::fs::create_dir_all(&units).unwrap();
    let system_units = ["/usr/lib/systemd/system", "/lib/systemd/system"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.join("sysinit.target").exists())
        .expect("this machine's systemd units (/usr/lib/systemd/system): install `systemd`");
    let out = run_with_limit(
        Command::new("cp").arg("-a").arg(system_units).arg(&units),
        TOOL_LIMIT,
    );
    assert!(
        out.status.success(),
        "copy the system units: {}",
        output_text(&out)
    );
    let etc = root.path().join("etc/systemd/system");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::copy(
        deploy::deploy_path("systemd/vantage.service"),
        etc.join("vantage.service"),
    )
    .unwrap();

    let unit = unit();
    let exec_start = value(section(&unit, "Service"), "ExecStart");
    let binary = exec_start
        .split_whitespace()
        .next()
        .expect("ExecStart= names a binary");
    assert!(
        binary.starts_with('/'),
        "ExecStart= needs an absolute path: {exec_start}"
    );
    let in_root = root.path().join(binary.trim_start_matches('/'));
    std::fs::create_dir_all(in_root.parent().unwrap()).unwrap();
    std::fs::write(&in_root, "#!/bin/sh\nexit 0\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&in_root, std::fs::Permissions::from_mode(0o755)).unwrap();
    root
}

#[test]
fn systemd_analyze_verify_accepts_the_unit_without_a_warning() {
    let root = unit_root();
    let out = run_with_limit(
        systemd_analyze()
            .arg("verify")
            .arg("--man=no")
            .arg("--generators=no")
            .arg(format!("--root={}", root.path().display()))
            .arg("vantage.service"),
        TOOL_LIMIT,
    );
    // Unknown or misspelt options, and hardening options this systemd does not know, are
    // warnings ("Unknown key ..., ignoring") with exit 0: the output must be empty too.
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "systemd-analyze verify vantage.service: {}",
        output_text(&out)
    );
}

#[test]
fn systemd_analyze_security_rates_the_unit_ok() {
    let root = unit_root();
    let out = run_with_limit(
        systemd_analyze()
            .arg("security")
            .arg("--offline=yes")
            .arg(format!("--root={}", root.path().display()))
            .arg("--no-pager")
            .arg("vantage.service"),
        TOOL_LIMIT,
    );
    assert!(
        out.status.success(),
        "systemd-analyze security: {}",
        output_text(&out)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    // "→ Overall exposure level for vantage.service: 1.1 OK 🙂" (0 = locked down, 10 = exposed).
    let exposure: f64 = stdout
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for vantage.service:")
                .nth(1)
        })
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no overall exposure level: {}", output_text(&out)));
    assert!(
        exposure <= 2.0,
        "the unit's exposure level is {exposure} (was 1.1 when it was written): a hardening \
         option was lost\n{stdout}"
    );
}

#[test]
fn unit_waits_for_a_graceful_shutdown_and_runs_the_daemon_as_designed() {
    let unit = unit();
    let service = section(&unit, "Service");
    let default_grace = Settings::default().worker.shutdown_grace;
    assert_eq!(default_grace, Duration::from_secs(30));
    let example = Settings::from_toml_str(&deploy::read_deploy("systemd/vantage.toml.example"))
        .expect("systemd/vantage.toml.example is a valid configuration");

    let stop = systemd_timespan(value(service, "TimeoutStopSec"));
    for shutdown_grace in [default_grace, example.worker.shutdown_grace] {
        assert!(
            stop > shutdown_grace + SHUTDOWN_OVERHEAD,
            "TimeoutStopSec ({stop:?}) must exceed worker.shutdown_grace ({shutdown_grace:?}) + \
             {SHUTDOWN_OVERHEAD:?}, or systemd SIGKILLs a draining daemon"
        );
    }
    let watchdog = systemd_timespan(value(service, "WatchdogSec"));
    assert!(watchdog > Duration::ZERO, "WatchdogSec= must be set");
    assert_eq!(value(service, "Type"), "notify");
    assert_eq!(value(service, "NotifyAccess"), "main");
    assert_eq!(value(service, "KillSignal"), "SIGTERM");
    assert_eq!(value(service, "Restart"), "on-failure");
    assert_eq!(
        value(service, "RestartPreventExitStatus"),
        ConfigError::EXIT_CODE.to_string()
    );
    assert_eq!(
        value(service, "ExecStart"),
        "/usr/local/bin/vantage run --config /etc/vantage/vantage.toml"
    );
    let nofile: u64 = value(service, "LimitNOFILE")
        .parse()
        .expect("LimitNOFILE= is a number");
    assert!(
        nofile >= 4096,
        "LimitNOFILE={nofile}: too low for a pool of connections plus HTTP clients"
    );
    assert_eq!(value(service, "DynamicUser"), "yes");
    assert_eq!(value(service, "ProtectSystem"), "strict");
}
