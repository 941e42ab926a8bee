//! The shipped alerts and dashboard against a real Prometheus scraping a real `vantage run`.
//!
//! Debian's `prometheus` (installed by `.ci/run`; a missing binary fails the test with the
//! package to install) runs on 127.0.0.1 on a free port, its data in a temporary directory,
//! with a 1 s scrape and evaluation interval, configured from
//! `deploy/prometheus/prometheus.example.yaml` and loading a copy of
//! `deploy/prometheus/vantage-alerts.yaml` whose `for:` durations are shortened (expressions,
//! thresholds and labels stay as shipped). The test then makes the daemon dead-letter poison
//! events, lets a backlog grow and age, breaks dead-letter moves of one perspective, and
//! watches the alerts fire through Prometheus's HTTP API (the default SLOs' fast burns too:
//! events applied 40 minutes after their append, poison events dead-lettered); it runs every
//! dashboard query and every SLO rule against the same Prometheus; finally it stops the daemon
//! and watches "no live instance" fire.
//!
//! Prometheus and the daemon are killed by guards, so a failing assertion leaves nothing
//! running.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::Signal;
use serde_json::{json, Value};
use serde_yaml_ng::Value as Yaml;
use uuid::Uuid;
use vantage::store::{NewEvent, Store, StoreOptions};

use crate::support;
use crate::support::deploy::{self, ChildGuard};
use crate::support::process::{self, Daemon};

/// How long `for:` lasts in the test copy of the rules.
const SHORT_FOR: &str = "2s";
/// Bounded waits for things that take a few sampler ticks (the daemon samples its database
/// gauges every 15 s).
const ALERT_LIMIT: Duration = Duration::from_secs(60);

const READ_MODEL_SQL: &str =
    "CREATE TABLE public.deploy_orders (stream_id uuid, version int, n int, PRIMARY KEY (stream_id, version))";

/// `orders` applies OrderPlaced; an event whose `n` is not a number fails every time (poison).
/// `fragile` always fails, and the test makes moving its events to the dead letters fail too.
/// `reporting` is registered in the database but not configured here: nothing drains it.
const PERSPECTIVES_TOML: &str = r#"
[[perspectives]]
name = "orders"
events = ["OrderPlaced"]
[perspectives.sql]
OrderPlaced = "INSERT INTO public.deploy_orders (stream_id, version, n) VALUES ($2, $6, ($1->>'n')::int)"

[[perspectives]]
name = "fragile"
events = ["Fragile"]
[perspectives.sql]
Fragile = "INSERT INTO public.deploy_orders (stream_id, version, n) VALUES ($2, $6, ($1->>'n')::int)"

# A versioned perspective: the version panels have a series to show.
[[perspectives]]
name = "summary"
read_schema = "deploy_rm"
tables = ["totals"]
setup = "CREATE TABLE totals (stream_id uuid PRIMARY KEY, n int NOT NULL)"
events = ["OrderPlaced"]
[perspectives.sql]
OrderPlaced = "INSERT INTO totals (stream_id, n) VALUES ($2, ($1->>'n')::int) ON CONFLICT (stream_id) DO UPDATE SET n = totals.n + EXCLUDED.n"
"#;

// ---------------------------------------------------------------------------------------------
// Prometheus

/// A running Prometheus, killed when dropped.
struct Prometheus {
    _guard: ChildGuard,
    addr: SocketAddr,
    log: std::path::PathBuf,
    started: f64,
}

impl Prometheus {
    /// Starts `prometheus` with `config` (a file in `dir`), data in `dir/data`, listening on
    /// 127.0.0.1 only, and waits until it is ready.
    fn start(dir: &Path, config: &Path) -> Prometheus {
        let binary = deploy::tool("prometheus", "prometheus");
        let log = dir.join("prometheus.log");
        let mut last_log = String::new();
        // A port found free can be taken before Prometheus binds it: try a few.
        for _ in 0..3 {
            let addr = SocketAddr::from(([127, 0, 0, 1], deploy::free_port()));
            let file = std::fs::File::create(&log).expect("prometheus log");
            let child = Command::new(&binary)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("data").display()
                ))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn")
                .current_dir(dir)
                .stdin(Stdio::null())
                .stdout(Stdio::from(file.try_clone().unwrap()))
                .stderr(Stdio::from(file))
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
            let mut guard = ChildGuard::new(child, "prometheus");
            let started = unix_now();
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if guard.try_wait().is_some() {
                    break;
                }
                if matches!(deploy::http_get(addr, "/-/ready"), Ok((200, _))) {
                    return Prometheus {
                        _guard: guard,
                        addr,
                        log,
                        started,
                    };
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            last_log = std::fs::read_to_string(&log).unwrap_or_default();
        }
        panic!("prometheus did not become ready; its log:\n{last_log}");
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// GET an API path; the `data` of a `"status": "success"` answer.
    fn api(&self, path_and_query: &str) -> Value {
        let (status, body) = deploy::http_get(self.addr, path_and_query)
            .unwrap_or_else(|e| panic!("GET {path_and_query} from prometheus: {e}"));
        let answer: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET {path_and_query}: not JSON ({e}): {body}"));
        assert!(
            status == 200 && answer["status"] == "success",
            "GET {path_and_query}: {status} {answer}"
        );
        answer["data"].clone()
    }

    /// An instant query's result vector.
    fn query(&self, promql: &str) -> Vec<Value> {
        let data = self.api(&format!(
            "/api/v1/query?query={}",
            deploy::urlencode(promql)
        ));
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// A range query over everything since Prometheus started, step 1 s, as a dashboard panel
    /// would ask it: the series that have at least one sample.
    fn query_range(&self, promql: &str) -> Vec<Value> {
        let data = self.api(&format!(
            "/api/v1/query_range?query={}&start={:.3}&end={:.3}&step=1",
            deploy::urlencode(promql),
            self.started - 1.0,
            unix_now()
        ));
        data["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s["values"].as_array().is_some_and(|v| !v.is_empty()))
            .collect()
    }

    /// Active alerts: (alertname, perspective label or "") → state (`pending` / `firing`).
    fn alerts(&self) -> BTreeMap<(String, String), String> {
        let data = self.api("/api/v1/alerts");
        data["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|a| {
                let name = a["labels"]["alertname"].as_str().unwrap_or("").to_owned();
                let perspective = a["labels"]["perspective"].as_str().unwrap_or("").to_owned();
                let state = a["state"].as_str().unwrap_or("").to_owned();
                ((name, perspective), state)
            })
            .collect()
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The shipped rule file with every `for:` shortened to [`SHORT_FOR`].
fn rules_with_short_for() -> String {
    let mut rules = deploy::yaml_deploy("prometheus/vantage-alerts.yaml");
    let groups = rules
        .get_mut("groups")
        .and_then(Yaml::as_sequence_mut)
        .expect("groups");
    let mut shortened = 0;
    for group in groups {
        let list = group
            .get_mut("rules")
            .and_then(Yaml::as_sequence_mut)
            .expect("rules");
        for rule in list {
            if let Some(f) = rule.get_mut("for") {
                *f = Yaml::String(SHORT_FOR.into());
                shortened += 1;
            }
        }
    }
    assert!(shortened > 0, "no `for:` in the rules?");
    serde_yaml_ng::to_string(&rules).expect("serialize the rules")
}

/// `deploy/prometheus/prometheus.example.yaml` with 1 s intervals, the test's rule file and
/// the daemon as its only target.
fn prometheus_config(rules: &[&Path], target: SocketAddr) -> String {
    let mut config = deploy::yaml_deploy("prometheus/prometheus.example.yaml");
    let global = config.get_mut("global").expect("global");
    global["scrape_interval"] = Yaml::String("1s".into());
    global["evaluation_interval"] = Yaml::String("1s".into());
    config["rule_files"] = Yaml::Sequence(
        rules
            .iter()
            .map(|r| Yaml::String(r.display().to_string()))
            .collect(),
    );
    let jobs = config
        .get_mut("scrape_configs")
        .and_then(Yaml::as_sequence_mut)
        .expect("scrape_configs");
    let job = jobs
        .iter_mut()
        .find(|j| j["job_name"] == Yaml::String("vantage".into()))
        .expect("a scrape job named vantage");
    job["scrape_timeout"] = Yaml::String("1s".into());
    job["static_configs"] = serde_yaml_ng::from_str(&format!("- targets: ['{target}']")).unwrap();
    serde_yaml_ng::to_string(&config).expect("serialize the config")
}

// ---------------------------------------------------------------------------------------------
// The scenario

async fn append(store: &Store, event_type: &str, data: Value, count: usize) {
    for _ in 0..count {
        store
            .append_events(
                Uuid::new_v4(),
                Some(0),
                &[NewEvent::new(event_type, data.clone())],
            )
            .await
            .expect("append");
    }
}

/// Polls until `check` returns `Ok`, failing with its last `Err` after `limit`.
async fn eventually<T>(
    what: &str,
    limit: Duration,
    context: impl Fn() -> String,
    mut check: impl FnMut() -> Result<T, String>,
) -> T {
    let started = Instant::now();
    loop {
        match check() {
            Ok(v) => return v,
            Err(last) => {
                assert!(
                    started.elapsed() < limit,
                    "{what}: not within {limit:?}; last: {last}\n{}",
                    context()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn firing(
    alerts: &BTreeMap<(String, String), String>,
    wanted: &[(&str, &str)],
) -> Result<(), String> {
    let missing: Vec<_> = wanted
        .iter()
        .filter(|(name, p)| {
            alerts
                .get(&((*name).to_owned(), (*p).to_owned()))
                .map(String::as_str)
                != Some("firing")
        })
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("not firing: {missing:?}; active: {alerts:?}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_alerts_fire_and_dashboard_queries_return_data_from_a_real_prometheus() {
    let test_started = Instant::now();
    let db = support::fresh_database().await;
    let store = Store::connect(&StoreOptions::for_url(&db.url))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    process::exec(&store, READ_MODEL_SQL).await;
    store
        .register_perspective("reporting", &["Report".to_owned()])
        .await
        .unwrap();
    // Moving `fragile` events to the dead letters fails, as it does when the daemon's role
    // lost its privileges on wh_dead_letters.
    process::exec(
        &store,
        "CREATE FUNCTION public.deploy_refuse_dead_letter() RETURNS trigger LANGUAGE plpgsql AS \
         $$BEGIN RAISE EXCEPTION 'permission denied for table wh_dead_letters' \
         USING ERRCODE = '42501'; END$$; \
         CREATE TRIGGER deploy_refuse_dead_letter BEFORE INSERT ON wh_dead_letters FOR EACH ROW \
         WHEN (NEW.perspective_name = 'fragile') EXECUTE FUNCTION public.deploy_refuse_dead_letter()",
    )
    .await;

    // A crashed instance holds leases on `orders` work: the daemon takes them over.
    store
        .register_perspective("orders", &["OrderPlaced".to_owned()])
        .await
        .unwrap();
    append(&store, "OrderPlaced", json!({"n": 1}), 5).await;
    // It stays alive (heartbeating) until Prometheus scrapes the daemon, and its events were
    // queued 40 minutes ago: once it dies, the daemon applies them 40 minutes late, which the
    // lag SLO's fast burn sees (after Prometheus saw the histogram at 0).
    let crashed = Uuid::new_v4();
    process::exec(
        &store,
        &format!(
            "SELECT heartbeat('{crashed}', 'vantage', 'crashed-host', 1, '0'); \
             SELECT count(*) FROM claim_orphaned_perspective_events('{crashed}', 600, 100, 1000); \
             UPDATE wh_perspective_events SET created_at = now() - interval '40 minutes' \
             WHERE instance_id = '{crashed}'"
        ),
    )
    .await;
    let alive = tokio_util::sync::CancellationToken::new();
    let heartbeats = tokio::spawn({
        let (store, alive) = (store.clone(), alive.clone());
        async move {
            while !alive.is_cancelled() {
                process::exec(
                    &store,
                    &format!("SELECT heartbeat('{crashed}', 'vantage', 'crashed-host', 1, '0')"),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    });
    assert_eq!(
        process::scalar(
            &store,
            &format!("SELECT count(*) FROM wh_perspective_events WHERE instance_id = '{crashed}'")
        )
        .await,
        5
    );

    // The daemon.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vantage.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[database]
url = "{url}"
[worker]
consumers = 2
max_perspective_event_attempts = 2
retry_backoff_base = "100ms"
retry_backoff_max = "200ms"
[orphans]
heartbeat_interval = "1s"
stale_after = "3s"
[http]
listen = "127.0.0.1:0"
[log]
level = "info"
{PERSPECTIVES_TOML}"#,
            url = db.url
        ),
    )
    .unwrap();
    let config_arg = config.to_str().unwrap().to_owned();
    let mut daemon = Daemon::spawn(
        process::vantage(dir.path(), &["--config", &config_arg, "run"], &[]),
        dir.path(),
        "vantage",
    );
    let daemon_addr = daemon
        .wait_running(Duration::from_secs(60))
        .await
        .expect("the daemon logs its HTTP address");

    // Prometheus, scraping it.
    let rules = dir.path().join("vantage-alerts.yaml");
    std::fs::write(&rules, rules_with_short_for()).unwrap();
    // The SLO rules as shipped (they have no `for:`).
    let slo_rules = dir.path().join("vantage-slo.yaml");
    std::fs::write(
        &slo_rules,
        deploy::read_deploy("prometheus/vantage-slo.yaml"),
    )
    .unwrap();
    let prom_config = dir.path().join("prometheus.yaml");
    std::fs::write(
        &prom_config,
        prometheus_config(&[&rules, &slo_rules], daemon_addr),
    )
    .unwrap();
    let check = deploy::run_with_limit(
        Command::new(deploy::tool("promtool", "prometheus"))
            .arg("check")
            .arg("config")
            .arg(&prom_config),
        Duration::from_secs(60),
    );
    assert!(
        check.status.success(),
        "the test's Prometheus config: {}",
        deploy::output_text(&check)
    );
    let prom = tokio::task::spawn_blocking({
        let dir = dir.path().to_owned();
        move || Prometheus::start(&dir, &prom_config)
    })
    .await
    .expect("start prometheus");
    let daemon_log = daemon.log.clone();
    let context = || {
        let log = process::strip_ansi(&std::fs::read_to_string(&daemon_log).unwrap_or_default());
        let lines: Vec<&str> = log.lines().collect();
        format!(
            "prometheus log:\n{}\ndaemon log:\n{}",
            prom.log_tail(),
            lines[lines.len().saturating_sub(30)..].join("\n")
        )
    };
    eventually("the daemon is scraped", ALERT_LIMIT, &context, || {
        let up = prom.query("up{job=\"vantage\"} == 1");
        let live = prom.query("max(vantage_instances_live) >= 1");
        if up.len() == 1 && live.len() == 1 {
            Ok(())
        } else {
            Err(format!("up: {up:?}, instances_live: {live:?}"))
        }
    })
    .await;
    // Alerts are evaluated every second: give them a few rounds, then nothing may fire yet
    // (in particular not "no live instance" while one runs and is scraped).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let quiet = prom.alerts();
    assert!(
        !quiet
            .keys()
            .any(|(name, _)| name == "VantageNoLiveInstance"),
        "VantageNoLiveInstance is active while the daemon runs and is scraped: {quiet:?}\n{}",
        context()
    );
    // The crashed instance dies now: the daemon takes its leases over.
    alive.cancel();
    heartbeats.await.expect("heartbeat task");
    process::exec(
        &store,
        &format!(
            "UPDATE wh_service_instances SET last_heartbeat_at = now() - interval '1 hour' \
             WHERE instance_id = '{crashed}'"
        ),
    )
    .await;

    // Wave 1: work that drains, one poison event, events nobody drains (aged 40 minutes),
    // and `fragile` events whose dead-letter moves fail.
    append(&store, "OrderPlaced", json!({"n": 2}), 20).await;
    append(&store, "OrderPlaced", json!({"n": "poison"}), 1).await;
    append(&store, "Report", json!({"n": 1}), 10).await;
    append(&store, "Fragile", json!({"n": "poison"}), 2).await;
    // A good event behind a poison one in its stream: it is given back (uncharged) while the
    // poison event waits for its retry.
    store
        .append_events(
            Uuid::new_v4(),
            Some(0),
            &[
                NewEvent::new("OrderPlaced", json!({"n": "poison"})),
                NewEvent::new("OrderPlaced", json!({"n": 3})),
            ],
        )
        .await
        .expect("append");
    process::exec(
        &store,
        "UPDATE wh_perspective_events SET created_at = now() - interval '40 minutes' \
         WHERE perspective_name = 'reporting'",
    )
    .await;

    let wave1 = [
        ("VantageDeadLettersGrowing", "orders"),
        ("VantageOpenDeadLetters", "orders"),
        ("VantageBacklogAgeHigh", "reporting"),
        ("VantageBacklogAgeCritical", "reporting"),
        ("VantageDeadLetterMoveErrors", ""),
        // The default SLOs: 5 of orders' ~26 events applied 40 minutes late, 2 dead-lettered.
        ("VantageLagSLOFastBurn", "orders"),
        ("VantageDeadLetterSLOFastBurn", "orders"),
    ];
    eventually("wave 1 alerts fire", ALERT_LIMIT, &context, || {
        firing(&prom.alerts(), &wave1)
    })
    .await;
    // ... and only those: nothing about the live instance, no backlog alert for the
    // perspectives that drain.
    let alerts = prom.alerts();
    for (name, perspective) in alerts.keys() {
        assert!(
            name != "VantageNoLiveInstance"
                && !(name.starts_with("VantageBacklogAge") && perspective != "reporting"),
            "unexpected alert {name} {perspective:?}: {alerts:?}"
        );
    }

    // Wave 2: a burst of poison events and a growing backlog.
    append(&store, "OrderPlaced", json!({"n": "poison"}), 60).await;
    append(&store, "Report", json!({"n": 2}), 10).await;
    eventually("the burst alert fires", ALERT_LIMIT, &context, || {
        firing(&prom.alerts(), &[("VantageDeadLetterBurst", "orders")])
    })
    .await;
    eventually("the backlog grows to 20", ALERT_LIMIT, &context, || {
        let backlog = prom.query("vantage_backlog_events{perspective=\"reporting\"} == 20");
        if backlog.len() == 1 {
            Ok(())
        } else {
            Err(format!("{:?}", prom.query("vantage_backlog_events")))
        }
    })
    .await;

    // Every dashboard query returns data from this Prometheus.
    check_dashboard(&prom, &context);
    // Every SLO rule's expression evaluates against the daemon's series, and every recording
    // rule has a value for a perspective that drains.
    check_slo_rules(&prom);

    // The daemon stops: "no live instance" fires.
    daemon.signal(Signal::SIGTERM);
    let code = daemon.wait(Duration::from_secs(60)).await;
    assert_eq!(
        code,
        Some(0),
        "graceful exit; log:\n{}",
        daemon.log_tail(30)
    );
    eventually("VantageNoLiveInstance fires", ALERT_LIMIT, &context, || {
        firing(&prom.alerts(), &[("VantageNoLiveInstance", "")])
    })
    .await;

    drop(prom);
    eprintln!(
        "deploy_prometheus scenario took {:?}",
        test_started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------------
// The SLO rules

fn check_slo_rules(prom: &Prometheus) {
    let rules = deploy::yaml_deploy("prometheus/vantage-slo.yaml");
    let mut records = BTreeSet::new();
    for rule in deploy::prometheus_rules(&rules) {
        let expr = deploy::str_at(rule, "vantage-slo.yaml", &["expr"]);
        // Evaluates (Prometheus.query fails the test on an error).
        let result = prom.query(expr);
        if let Some(record) = rule.get("record").and_then(Yaml::as_str) {
            let slo = deploy::str_at(rule, "vantage-slo.yaml", &["labels", "slo"]);
            assert!(
                result
                    .iter()
                    .any(|s| s["metric"]["perspective"] == "orders"),
                "{record} (slo {slo}) has no value for orders: {expr}\n{result:?}"
            );
            records.insert(format!("{record}{{slo=\"{slo}\",perspective=\"orders\"}}"));
        }
    }
    assert!(records.len() >= 10, "{records:?}");
    for series in &records {
        assert!(
            !prom.query(series).is_empty(),
            "Prometheus recorded no {series}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The dashboard

/// Dashboard queries that may be empty in this scenario, with the reason. Their metric names
/// are checked against the daemon's /metrics by artifacts.rs (which records every metric).
const MAY_BE_EMPTY: &[(&str, &str)] = &[(
    "sum by (perspective) (rate(vantage_cooldown_skips_total{perspective=~\"$perspective\"}[$__rate_interval]))",
    "a cooldown skip needs a row claimed again before its completion is visible (a race this \
     scenario cannot provoke on purpose), and the daemon exports a counter only once it has \
     counted something",
)];

/// Grafana's variables, as a dashboard with "All" selected would send them.
fn substitute_variables(expr: &str) -> String {
    let out = expr
        .replace("${perspective}", ".*")
        .replace("$perspective", ".*")
        .replace("$__rate_interval", "5s")
        .replace("$__interval", "1s")
        .replace("$__range", "5m");
    assert!(!out.contains('$'), "unknown dashboard variable in {expr}");
    out
}

fn check_dashboard(prom: &Prometheus, context: &dyn Fn() -> String) {
    let dashboard: Value =
        serde_json::from_str(&deploy::read_deploy("grafana/vantage-dashboard.json")).unwrap();
    let mut checked = 0;
    let mut empty = Vec::new();
    let mut allowed_empty = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().unwrap_or("?");
        for target in panel["targets"].as_array().into_iter().flatten() {
            let Some(expr) = target["expr"].as_str() else {
                continue;
            };
            checked += 1;
            let series = prom.query_range(&substitute_variables(expr));
            if series.is_empty() {
                if MAY_BE_EMPTY.iter().any(|(e, _)| *e == expr) {
                    allowed_empty.insert(expr);
                } else {
                    empty.push(format!("panel {title:?}: {expr}"));
                }
                continue;
            }
            // Every label the legend names is on the series.
            let legend = target["legendFormat"].as_str().unwrap_or("");
            for label in legend
                .split("{{")
                .skip(1)
                .filter_map(|rest| rest.split_once("}}").map(|(l, _)| l.trim()))
            {
                assert!(
                    series.iter().all(|s| s["metric"].get(label).is_some()),
                    "panel {title:?}: the legend uses {{{{{label}}}}} but the series of {expr} \
                     have no such label: {series:?}"
                );
            }
        }
    }
    assert!(checked > 15, "only {checked} dashboard queries found");
    assert!(
        empty.is_empty(),
        "dashboard queries without data from a Prometheus scraping the daemon:\n{}\n{}",
        empty.join("\n"),
        context()
    );
    // The `perspective` variable's query, as Grafana's label_values() asks it.
    let vars = dashboard["templating"]["list"]
        .as_array()
        .expect("variables");
    for var in vars.iter().filter(|v| v["type"] == "query") {
        let query = var["definition"].as_str().expect("a variable definition");
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| {
                panic!("variable query is not label_values(metric, label): {query}")
            });
        let (metric, label) = inner.split_once(',').expect("label_values(metric, label)");
        let values = prom.api(&format!(
            "/api/v1/label/{}/values?match[]={}",
            label.trim(),
            deploy::urlencode(metric.trim())
        ));
        let values: Vec<&str> = values
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        for p in ["orders", "fragile", "reporting"] {
            assert!(
                values.contains(&p),
                "variable {query} should offer {p}: {values:?}"
            );
        }
    }
    // An allowance that turned out unneeded is reported, to be removed.
    for (expr, why) in MAY_BE_EMPTY {
        if !allowed_empty.contains(expr) {
            eprintln!("note: {expr} returned data after all ({why})");
        }
    }
}
