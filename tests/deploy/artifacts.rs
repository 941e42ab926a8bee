//! The deploy artefacts (`deploy/`) against the code, read with real parsers (JSON, YAML): every
//! metric the Grafana dashboard and the Prometheus alerts use is one the daemon really exports
//! on `/metrics`; the dashboard's data source is a variable; the Kubernetes manifests fit the
//! daemon (probe paths it serves, its port, its config file, a grace period above
//! `worker.shutdown_grace` + 15 s) and each other, and lock the container down; and the
//! daemon's role from `privileges.sql` can do the daemon's work without being able to create
//! anything. The systemd unit and the Prometheus files are checked by their own tools in
//! `tools`, the alerts and dashboard against a real Prometheus in `prometheus`.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use serde_yaml_ng::Value as Yaml;
use sqlx::{Connection, PgConnection, Row};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;
use vantage::config::Settings;
use vantage::internals::telemetry::http::{self, Health, HttpState};
use vantage::internals::telemetry::recorder;
use vantage::store::{Store, StoreOptions};
use vantage::telemetry::metrics as m;

use crate::support;
use crate::support::deploy::{self, at, seq_at, str_at};

// ---------------------------------------------------------------------------------------------
// Helpers

/// One HTTP/1.1 GET over a plain TCP stream: (status, head, body).
async fn http_get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the HTTP server");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("response within 10 s")
        .expect("read");
    let text = String::from_utf8(raw).expect("UTF-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("HTTP head and body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status code in {head:?}"));
    (status, head.to_owned(), body.to_owned())
}

/// Records one sample of every metric in [`m::ALL`], with the labels it carries in production.
fn emit_every_metric() {
    const P: &str = "deploy_artifacts_test";
    for &name in m::ALL {
        match name {
            m::DEAD_LETTER_MOVES_TOTAL => {
                metrics::counter!(name, m::LABEL_PERSPECTIVE => P, m::LABEL_REASON => "MaxAttemptsExceeded")
                    .increment(1);
            }
            m::EVENTS_CLAIMED_TOTAL
            | m::EVENTS_APPLIED_TOTAL
            | m::APPLY_FAILURES_TOTAL
            | m::COOLDOWN_SKIPS_TOTAL
            | m::LEASE_TAKEOVERS_TOTAL
            | m::PERSPECTIVE_QUARANTINES_TOTAL
            | m::LANES_REPAIRED_TOTAL => {
                metrics::counter!(name, m::LABEL_PERSPECTIVE => P).increment(1);
            }
            m::DEAD_LETTER_MOVE_ERRORS_TOTAL
            | m::LEASES_RELEASED_TOTAL
            | m::TRACE_SPANS_EXPORTED_TOTAL
            | m::TRACE_SPANS_FAILED_TOTAL => {
                metrics::counter!(name).increment(1);
            }
            m::APPLY_DURATION_SECONDS => {
                metrics::histogram!(name, m::LABEL_PERSPECTIVE => P).record(0.004);
            }
            m::CLAIM_DURATION_SECONDS => metrics::histogram!(name).record(0.002),
            m::APPEND_TO_APPLIED_SECONDS => {
                metrics::histogram!(name, m::LABEL_PERSPECTIVE => P).record(0.04);
            }
            m::BACKLOG_EVENTS
            | m::DEAD_LETTERS
            | m::OLDEST_PENDING_AGE_SECONDS
            | m::BLOCKED_LANES
            | m::BLOCKED_EVENTS
            | m::PERSPECTIVE_PAUSED => {
                metrics::gauge!(name, m::LABEL_PERSPECTIVE => P).set(1.0);
            }
            m::INSTANCES_LIVE => metrics::gauge!(name).set(1.0),
            m::PERSPECTIVE_VERSION_BEHIND => {
                metrics::gauge!(name, m::LABEL_PERSPECTIVE => P, m::LABEL_VERSION => "2").set(1.0);
            }
            m::PERSPECTIVE_LIVE_VERSION => {
                metrics::gauge!(name, m::LABEL_PERSPECTIVE => P).set(1.0);
            }
            // Set by recorder::install.
            m::BUILD_INFO => {}
            other => panic!(
                "metric {other} is in metrics::ALL but this test does not know its kind: add it to \
                 emit_every_metric (and to metrics::describe_all)"
            ),
        }
    }
}

/// Every `vantage_*` identifier in a PromQL expression, as written (with `_bucket` etc.).
fn vantage_tokens(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.starts_with("vantage_"))
        .map(str::to_owned)
        .collect()
}

/// The exported metric a token refers to: itself, or a histogram's series without its suffix.
fn metric_of(token: &str) -> String {
    if m::ALL.contains(&token) {
        return token.to_owned();
    }
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = token.strip_suffix(suffix) {
            return base.to_owned();
        }
    }
    token.to_owned()
}

/// Every PromQL expression of the dashboard: panel targets (`expr`) and variable queries.
fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr" | "definition", Value::String(s)) => out.push(s.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|i| walk(i, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(dashboard, &mut out);
    if let Some(vars) = dashboard["templating"]["list"].as_array() {
        for var in vars.iter().filter(|v| v["type"] == "query") {
            match &var["query"] {
                Value::String(s) => out.push(s.clone()),
                q => out.extend(q["query"].as_str().map(str::to_owned)),
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Metrics: exported, described, and the only ones dashboards and alerts use

#[tokio::test]
async fn dashboard_and_alerts_use_only_metrics_the_daemon_exports() {
    let handle = recorder::install().expect("install the recorder");
    emit_every_metric();

    let health = Health::new();
    let (listener, addr) = http::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind port 0");
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(http::serve_on(
        listener,
        HttpState::new(handle, health),
        shutdown.clone(),
    ));
    let (status, head, scrape) = http_get(addr, "/metrics").await;
    shutdown.cancel();
    server
        .await
        .expect("server task")
        .expect("server stops cleanly");

    assert_eq!(status, 200, "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    for name in m::ALL {
        assert!(
            scrape.contains(&format!("# TYPE {name} ")),
            "{name} is missing from /metrics:\n{scrape}"
        );
        assert!(
            scrape.contains(&format!("# HELP {name} ")),
            "{name} has no description (metrics::describe_all)"
        );
    }
    for name in [
        m::APPLY_DURATION_SECONDS,
        m::CLAIM_DURATION_SECONDS,
        m::APPEND_TO_APPLIED_SECONDS,
    ] {
        assert!(
            scrape.contains(&format!("# TYPE {name} histogram")),
            "{name} must be a Prometheus histogram (explicit buckets), not a summary"
        );
    }

    let dashboard: Value =
        serde_json::from_str(&deploy::read_deploy("grafana/vantage-dashboard.json"))
            .expect("dashboard JSON");
    let alerts = deploy::prometheus_exprs(&deploy::yaml_deploy("prometheus/vantage-alerts.yaml"));
    let slo = deploy::prometheus_exprs(&deploy::yaml_deploy("prometheus/vantage-slo.yaml"));
    let slo_text = slo.join("\n");
    for needed in [
        m::APPEND_TO_APPLIED_SECONDS,
        m::DEAD_LETTER_MOVES_TOTAL,
        m::EVENTS_APPLIED_TOTAL,
    ] {
        assert!(slo_text.contains(needed), "no SLO rule uses {needed}");
    }
    let sources = [
        (
            "grafana/vantage-dashboard.json",
            dashboard_exprs(&dashboard),
        ),
        ("prometheus/vantage-alerts.yaml", alerts.clone()),
        ("prometheus/vantage-slo.yaml", slo),
    ];
    let mut used = BTreeSet::new();
    for (file, exprs) in &sources {
        assert!(!exprs.is_empty(), "no PromQL expressions found in {file}");
        for expr in exprs {
            for token in vantage_tokens(expr) {
                let metric = metric_of(&token);
                assert!(
                    m::ALL.contains(&metric.as_str()),
                    "{file} uses {token}, which is not a vantage metric (metrics::ALL): {expr}"
                );
                assert!(
                    scrape.lines().any(|l| l.starts_with(&token)),
                    "{file} uses {token}, which /metrics does not expose: {expr}"
                );
                used.insert(metric);
            }
        }
    }
    // The dashboard alone covers what docs/operations.md ("Logs and metrics") asks of it.
    let dashboard_text = dashboard_exprs(&dashboard).join("\n");
    for needed in [
        m::EVENTS_APPLIED_TOTAL,
        m::BACKLOG_EVENTS,
        m::OLDEST_PENDING_AGE_SECONDS,
        m::DEAD_LETTER_MOVES_TOTAL,
        m::DEAD_LETTERS,
        m::APPLY_DURATION_SECONDS,
        m::CLAIM_DURATION_SECONDS,
        m::INSTANCES_LIVE,
        m::DEAD_LETTER_MOVE_ERRORS_TOTAL,
        m::APPLY_FAILURES_TOTAL,
        m::BLOCKED_LANES,
        m::BLOCKED_EVENTS,
        m::PERSPECTIVE_PAUSED,
    ] {
        assert!(
            dashboard_text.contains(needed),
            "the dashboard has no panel for {needed}"
        );
    }
    let alert_text = alerts.join("\n");
    for needed in [
        m::DEAD_LETTER_MOVES_TOTAL,
        m::OLDEST_PENDING_AGE_SECONDS,
        m::INSTANCES_LIVE,
        m::DEAD_LETTER_MOVE_ERRORS_TOTAL,
        m::BLOCKED_EVENTS,
        m::PERSPECTIVE_PAUSED,
        m::PERSPECTIVE_QUARANTINES_TOTAL,
    ] {
        assert!(alert_text.contains(needed), "no alert rule uses {needed}");
    }
    assert!(
        alert_text.contains(&format!("absent({})", m::INSTANCES_LIVE)),
        "the no-live-instance alert must also fire when the metric is absent"
    );
    assert!(used.len() >= 10, "suspiciously few metrics used: {used:?}");
}

#[test]
fn promql_helpers_find_metric_names() {
    let expr = r#"histogram_quantile(0.99, sum by (le) (rate(vantage_apply_duration_seconds_bucket{perspective=~"$perspective"}[$__rate_interval])))"#;
    let tokens = vantage_tokens(expr);
    assert_eq!(
        tokens.into_iter().collect::<Vec<_>>(),
        ["vantage_apply_duration_seconds_bucket"]
    );
    assert_eq!(
        metric_of("vantage_apply_duration_seconds_bucket"),
        m::APPLY_DURATION_SECONDS
    );
    assert_eq!(metric_of(m::EVENTS_APPLIED_TOTAL), m::EVENTS_APPLIED_TOTAL);
}

// ---------------------------------------------------------------------------------------------
// Grafana: the data source is a variable

#[test]
fn dashboard_datasource_is_a_template_variable() {
    let dashboard: Value =
        serde_json::from_str(&deploy::read_deploy("grafana/vantage-dashboard.json"))
            .expect("dashboard JSON");
    let is_variable = |s: &str| s == "${datasource}" || s == "$datasource";

    fn check(v: &Value, path: &str, is_variable: &dyn Fn(&str) -> bool, count: &mut usize) {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    let here = format!("{path}.{k}");
                    if k == "datasource" {
                        *count += 1;
                        let ok = match v {
                            Value::String(s) => is_variable(s),
                            Value::Object(ds) => {
                                ds.get("uid")
                                    .and_then(Value::as_str)
                                    .is_some_and(is_variable)
                                    && ds.get("type").and_then(Value::as_str) == Some("prometheus")
                            }
                            _ => false,
                        };
                        assert!(ok, "{here} is a hard-coded data source: {v}");
                    } else if k == "uid" && path != "$" {
                        panic!("{here}: a uid outside a datasource variable reference: {v}");
                    } else {
                        check(v, &here, is_variable, count);
                    }
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    check(item, &format!("{path}[{i}]"), is_variable, count);
                }
            }
            _ => {}
        }
    }
    let mut count = 0;
    check(&dashboard, "$", &is_variable, &mut count);
    assert!(
        count > 10,
        "expected every panel and target to name the data source"
    );
    assert!(
        dashboard.get("__inputs").is_none(),
        "no import-time DS_ inputs"
    );

    let vars = dashboard["templating"]["list"]
        .as_array()
        .expect("templating variables");
    let ds = vars
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a `datasource` variable");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    let perspective = vars
        .iter()
        .find(|v| v["name"] == "perspective")
        .expect("a `perspective` variable");
    assert!(perspective.to_string().contains(&format!(
        "label_values({}, {})",
        m::BACKLOG_EVENTS,
        m::LABEL_PERSPECTIVE
    )));
}

// ---------------------------------------------------------------------------------------------
// Orchestrators, configuration examples

/// What the daemon may take beyond `worker.shutdown_grace` to stop (releasing leases,
/// deregistering, closing the pool: about 10 s in the worst case), plus a margin. The systemd
/// unit's TimeoutStopSec is checked against the same margin in tools.rs.
const SHUTDOWN_OVERHEAD: Duration = Duration::from_secs(15);

/// Kinds (and their apiVersion) the manifests may use: those of Kubernetes itself, kustomize
/// and the Prometheus Operator, at their stable versions.
const KNOWN_KINDS: &[(&str, &str)] = &[
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
];

/// Every manifest of deploy/kubernetes, parsed: file name → document.
fn kubernetes_manifests() -> std::collections::BTreeMap<String, Yaml> {
    let dir = deploy::deploy_path("kubernetes");
    let mut out = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(&dir).expect("deploy/kubernetes") {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".yaml") || name.ends_with(".yml") {
            let doc = deploy::yaml_deploy(&format!("kubernetes/{name}"));
            out.insert(name, doc);
        }
    }
    out
}

/// The `key: value` pairs of a label map.
fn labels(value: &Yaml, file: &str, path: &[&str]) -> std::collections::BTreeMap<String, String> {
    at(value, file, path)
        .as_mapping()
        .unwrap_or_else(|| panic!("{file}: `{}` is not a map", path.join(".")))
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().expect("label key").to_owned(),
                v.as_str().expect("label value").to_owned(),
            )
        })
        .collect()
}

/// Whether every label of `selector` is on `target`.
fn selects(
    selector: &std::collections::BTreeMap<String, String>,
    target: &std::collections::BTreeMap<String, String>,
) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| target.get(k) == Some(v))
}

/// A container's or pod's `securityContext` must lock the process down.
fn assert_locked_down(container: &Yaml, file: &str) {
    let name = str_at(container, file, &["name"]);
    let sc = at(container, file, &["securityContext"]);
    for (key, want) in [
        ("allowPrivilegeEscalation", false),
        ("readOnlyRootFilesystem", true),
        ("runAsNonRoot", true),
    ] {
        assert_eq!(
            sc.get(key).and_then(Yaml::as_bool),
            Some(want),
            "{file}: container {name}: securityContext.{key} must be {want}"
        );
    }
    let dropped: Vec<&str> = seq_at(sc, file, &["capabilities", "drop"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(
        dropped,
        ["ALL"],
        "{file}: container {name} must drop ALL capabilities"
    );
    let resources = at(container, file, &["resources"]);
    for path in [
        ["requests", "cpu"],
        ["requests", "memory"],
        ["limits", "memory"],
    ] {
        assert!(
            resources
                .get(path[0])
                .and_then(|r| r.get(path[1]))
                .is_some(),
            "{file}: container {name} has no resources.{}",
            path.join(".")
        );
    }
}

#[tokio::test]
async fn kubernetes_manifests_fit_the_daemon_and_each_other() {
    let manifests = kubernetes_manifests();
    let kustomization = &manifests["kustomization.yaml"];
    let listed: BTreeSet<&str> = seq_at(kustomization, "kustomization.yaml", &["resources"])
        .iter()
        .map(|r| r.as_str().expect("resource path"))
        .collect();
    for (file, doc) in &manifests {
        let api = str_at(doc, file, &["apiVersion"]);
        let kind = str_at(doc, file, &["kind"]);
        assert!(
            KNOWN_KINDS.contains(&(api, kind)),
            "{file}: unknown apiVersion/kind {api}/{kind}"
        );
        if kind != "Kustomization" {
            str_at(doc, file, &["metadata", "name"]);
            assert_eq!(
                str_at(doc, file, &["metadata", "labels", "app.kubernetes.io/name"]),
                "vantage",
                "{file}: labels"
            );
        }
        // Everything is applied by `kubectl apply -k`, except the example Secret (on purpose).
        if kind != "Kustomization" && file != "secret.example.yaml" {
            assert!(
                listed.contains(file.as_str()),
                "kustomization.yaml does not list {file}"
            );
        }
    }
    for resource in &listed {
        assert!(
            manifests.contains_key(*resource),
            "kustomization.yaml lists missing {resource}"
        );
    }
    assert!(
        !listed.contains("secret.example.yaml"),
        "the example Secret must not be applied"
    );

    let f = "deployment.yaml";
    let deployment = &manifests[f];
    let pod = at(deployment, f, &["spec", "template", "spec"]);
    let pod_labels = labels(deployment, f, &["spec", "template", "metadata", "labels"]);
    assert!(
        selects(
            &labels(deployment, f, &["spec", "selector", "matchLabels"]),
            &pod_labels
        ),
        "{f}: the selector does not select the pod template"
    );

    // Shutdown: the kubelet waits for the daemon's worst case.
    let configmap = &manifests["configmap.yaml"];
    let config_key = "vantage.toml";
    let configured =
        Settings::from_toml_str(str_at(configmap, "configmap.yaml", &["data", config_key]))
            .expect("the ConfigMap's vantage.toml is a valid configuration");
    let default_grace = Settings::default().worker.shutdown_grace;
    assert_eq!(default_grace, Duration::from_secs(30));
    let grace = at(pod, f, &["terminationGracePeriodSeconds"])
        .as_u64()
        .expect("terminationGracePeriodSeconds is a number of seconds");
    for shutdown_grace in [default_grace, configured.worker.shutdown_grace] {
        assert!(
            Duration::from_secs(grace) > shutdown_grace + SHUTDOWN_OVERHEAD,
            "terminationGracePeriodSeconds ({grace}) must exceed worker.shutdown_grace \
             ({shutdown_grace:?}) + {SHUTDOWN_OVERHEAD:?}, or the kubelet SIGKILLs a draining daemon"
        );
    }

    // Non-root, read-only, no capabilities, resources set; for the init container too.
    let pod_sc = at(pod, f, &["securityContext"]);
    assert_eq!(
        pod_sc.get("runAsNonRoot").and_then(Yaml::as_bool),
        Some(true)
    );
    let uid = at(pod_sc, f, &["runAsUser"]).as_u64().expect("runAsUser");
    assert_ne!(uid, 0, "{f}: runAsUser must not be root");
    assert_eq!(
        at(pod, f, &["automountServiceAccountToken"]).as_bool(),
        Some(false),
        "{f}: the daemon needs no Kubernetes API token"
    );
    let init = seq_at(pod, f, &["initContainers"]);
    let containers = seq_at(pod, f, &["containers"]);
    for container in init.iter().chain(containers) {
        assert_locked_down(container, f);
    }

    // The daemon's container: the config file from the ConfigMap, the URL from the Secret,
    // HTTP on the port the probes, the Service and the ServiceMonitor use.
    let daemon = containers
        .iter()
        .find(|c| c["name"] == Yaml::String("vantage".into()))
        .expect("a container named vantage");
    let args: Vec<&str> = seq_at(daemon, f, &["args"])
        .iter()
        .filter_map(Yaml::as_str)
        .collect();
    assert_eq!(
        args.first(),
        Some(&"run"),
        "{f}: the container runs `vantage run`"
    );
    let config_path = args
        .windows(2)
        .find(|w| w[0] == "--config")
        .map(|w| w[1])
        .expect("--config PATH");
    let config_volume = seq_at(pod, f, &["volumes"])
        .iter()
        .find(|v| v.get("configMap").is_some())
        .expect("a ConfigMap volume");
    assert_eq!(
        str_at(config_volume, f, &["configMap", "name"]),
        str_at(configmap, "configmap.yaml", &["metadata", "name"])
    );
    let mount = seq_at(daemon, f, &["volumeMounts"])
        .iter()
        .find(|m| m["name"] == config_volume["name"])
        .expect("the ConfigMap volume is mounted");
    assert_eq!(
        format!("{}/{config_key}", str_at(mount, f, &["mountPath"])),
        config_path,
        "{f}: --config must name the ConfigMap's {config_key}"
    );

    let secret = &manifests["secret.example.yaml"];
    let secret_name = str_at(secret, "secret.example.yaml", &["metadata", "name"]);
    let env_of = |container: &Yaml, name: &str| -> Yaml {
        seq_at(container, f, &["env"])
            .iter()
            .find(|e| e["name"] == Yaml::String(name.into()))
            .unwrap_or_else(|| panic!("{f}: no env {name}"))
            .clone()
    };
    for container in init.iter().chain(std::iter::once(daemon)) {
        let url = env_of(container, "DATABASE_URL");
        let secret_ref = at(&url, f, &["valueFrom", "secretKeyRef"]);
        assert_eq!(str_at(secret_ref, f, &["name"]), secret_name);
        let key = str_at(secret_ref, f, &["key"]);
        assert!(
            secret.get("stringData").and_then(|d| d.get(key)).is_some(),
            "{f}: DATABASE_URL comes from key {key}, which secret.example.yaml lacks"
        );
    }

    let listen: SocketAddr = str_at(&env_of(daemon, "VANTAGE__HTTP__LISTEN"), f, &["value"])
        .parse()
        .expect("VANTAGE__HTTP__LISTEN is an address");
    assert!(
        listen.ip().is_unspecified(),
        "{f}: the probes and Prometheus reach the pod from outside: listen on 0.0.0.0"
    );
    let port = seq_at(daemon, f, &["ports"])
        .iter()
        .find(|p| at(p, f, &["containerPort"]).as_u64() == Some(u64::from(listen.port())))
        .unwrap_or_else(|| panic!("{f}: no containerPort {}", listen.port()));
    let port_name = str_at(port, f, &["name"]);

    // Probes: on that port, at paths the daemon serves.
    let handle = recorder::install().expect("install the recorder");
    let (listener, addr) = http::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind port 0");
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(http::serve_on(
        listener,
        HttpState::new(handle, Health::new()),
        shutdown.clone(),
    ));
    let mut probe_paths = BTreeSet::new();
    for (probe, want_path) in [
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ] {
        let get = at(daemon, f, &[probe, "httpGet"]);
        assert_eq!(str_at(get, f, &["port"]), port_name, "{f}: {probe} port");
        let path = str_at(get, f, &["path"]);
        assert_eq!(path, want_path, "{f}: {probe} path");
        probe_paths.insert(path.to_owned());
    }
    for path in &probe_paths {
        let (status, head, _) = http_get(addr, path).await;
        assert!(
            status == 200 || status == 503,
            "the daemon does not serve the probe path {path}: {head}"
        );
    }

    // Service: selects the pods, exposes that port by name.
    let sf = "service.yaml";
    let service = &manifests[sf];
    assert!(selects(
        &labels(service, sf, &["spec", "selector"]),
        &pod_labels
    ));
    let service_port = seq_at(service, sf, &["spec", "ports"])
        .iter()
        .find(|p| p.get("targetPort").and_then(Yaml::as_str) == Some(port_name))
        .unwrap_or_else(|| panic!("{sf}: no port targets {port_name}"));
    let service_port_name = str_at(service_port, sf, &["name"]);

    // ServiceMonitor: selects the Service and scrapes its port by name, at /metrics.
    let mf = "servicemonitor.yaml";
    let monitor = &manifests[mf];
    assert!(
        selects(
            &labels(monitor, mf, &["spec", "selector", "matchLabels"]),
            &labels(service, sf, &["metadata", "labels"])
        ),
        "{mf}: the selector does not select the Service"
    );
    let endpoints = seq_at(monitor, mf, &["spec", "endpoints"]);
    assert!(!endpoints.is_empty());
    for endpoint in endpoints {
        assert_eq!(
            str_at(endpoint, mf, &["port"]),
            service_port_name,
            "{mf}: endpoints must name the Service's port"
        );
        let path = str_at(endpoint, mf, &["path"]);
        let (status, head, _) = http_get(addr, path).await;
        assert_eq!(status, 200, "{mf} scrapes {path}: {head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
    }
    shutdown.cancel();
    server
        .await
        .expect("server task")
        .expect("server stops cleanly");

    // PodDisruptionBudget: selects the pods.
    let pf = "poddisruptionbudget.yaml";
    assert!(selects(
        &labels(&manifests[pf], pf, &["spec", "selector", "matchLabels"]),
        &pod_labels
    ));

    // The image the kustomization pins is the one the containers use.
    let images: BTreeSet<&str> = seq_at(kustomization, "kustomization.yaml", &["images"])
        .iter()
        .map(|i| str_at(i, "kustomization.yaml", &["name"]))
        .collect();
    for container in init.iter().chain(containers) {
        let image = str_at(container, f, &["image"]);
        let name = image.rsplit_once(':').map_or(image, |(n, _)| n);
        assert!(
            images.contains(name),
            "{f}: image {image} is not in kustomization images"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL: the daemon's role is enough, and no more

/// `url` with another user and password.
fn as_role(url: &str, role: &str, password: &str) -> String {
    let mut url = url::Url::parse(url).expect("database URL");
    url.set_username(role).expect("set user");
    url.set_password(Some(password)).expect("set password");
    url.to_string()
}

fn is_permission_denied(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("42501"))
}

/// The three roles of deploy/postgres/privileges.sql, created for one test under names of their
/// own (roles are cluster-wide), with a password each.
struct Roles {
    daemon: String,
    producer: String,
    operator: String,
    password: String,
    admin: PgConnection,
}

impl Roles {
    async fn create(url: &str) -> Roles {
        let suffix = &Uuid::new_v4().simple().to_string()[..10];
        let daemon = format!("vt_daemon_{suffix}");
        let producer = format!("vt_producer_{suffix}");
        let operator = format!("vt_operator_{suffix}");
        let password = Uuid::new_v4().simple().to_string();
        let script = deploy::read_deploy("postgres/privileges.sql")
            .replace("vantage_daemon", &daemon)
            .replace("vantage_producer", &producer)
            .replace("vantage_operator", &operator);
        let mut admin = PgConnection::connect(url).await.expect("admin connection");
        sqlx::raw_sql(&script)
            .execute(&mut admin)
            .await
            .expect("privileges.sql runs");
        // Idempotent: a second run (after the next migration) must succeed too.
        sqlx::raw_sql(&script)
            .execute(&mut admin)
            .await
            .expect("privileges.sql runs twice");
        for role in [&daemon, &producer, &operator] {
            sqlx::raw_sql(&format!("ALTER ROLE {role} PASSWORD '{password}'"))
                .execute(&mut admin)
                .await
                .expect("set password");
        }
        Roles {
            daemon,
            producer,
            operator,
            password,
            admin,
        }
    }

    async fn drop_all(mut self) {
        for role in [&self.operator, &self.producer, &self.daemon] {
            let _ = sqlx::raw_sql(&format!("DROP OWNED BY {role}; DROP ROLE IF EXISTS {role}"))
                .execute(&mut self.admin)
                .await;
        }
        let _ = self.admin.close().await;
    }
}

#[tokio::test]
async fn privileges_sql_lets_the_daemon_work_without_owning_anything() {
    let db = support::fresh_database().await;
    let owner = Store::connect(&StoreOptions::for_url(&db.url))
        .await
        .expect("connect as the test's admin");
    owner.migrate().await.expect("migrate as the owner");
    let roles = Roles::create(&db.url).await;
    let outcome = exercise_roles(
        &db.url,
        &roles.daemon,
        &roles.producer,
        &roles.operator,
        &roles.password,
    )
    .await;
    owner.close().await;
    roles.drop_all().await;
    outcome.unwrap_or_else(|e| panic!("{e}"));
}

/// Runs the binary as `role` with `args` (and `input` on stdin); returns (exit code, stderr).
async fn vantage_as(
    url: &str,
    role: &str,
    password: &str,
    args: &[&str],
    input: &str,
) -> (i32, String) {
    use std::process::Stdio;
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_vantage"));
    for (name, _) in std::env::vars_os() {
        let upper = name.to_string_lossy().to_ascii_uppercase();
        if upper == "DATABASE_URL" || upper.starts_with("VANTAGE") || upper.starts_with("PG") {
            cmd.env_remove(&name);
        }
    }
    let mut child = cmd
        .args(args)
        .env("DATABASE_URL", as_role(url, role, password))
        .env("RUST_LOG", "warn")
        .current_dir(std::env::temp_dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn vantage");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).await.unwrap();
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("vantage finished within a minute")
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Each documented role runs its documented commands through the real binary (issue #8): the
/// producer appends, the operator reads status and dead letters and requeues them.
#[tokio::test]
async fn each_role_runs_its_documented_commands() {
    let db = support::fresh_database().await;
    let owner = Store::connect(&StoreOptions::for_url(&db.url))
        .await
        .expect("connect as the test's admin");
    owner.migrate().await.expect("migrate as the owner");
    owner
        .register_perspective("orders", &["OrderPlaced".to_string()])
        .await
        .unwrap();
    let roles = Roles::create(&db.url).await;
    let (url, pw) = (db.url.as_str(), roles.password.as_str());
    let line = format!(
        "{{\"stream_id\": \"{}\", \"event_type\": \"OrderPlaced\", \"data\": {{}}}}\n",
        Uuid::new_v4()
    );
    let mut failures = Vec::new();
    let runs: Vec<(&str, Vec<&str>, &str)> = vec![
        (&roles.producer, vec!["append"], line.as_str()),
        (&roles.operator, vec!["status"], ""),
        (&roles.operator, vec!["perspectives", "list"], ""),
        (&roles.operator, vec!["dlq", "list"], ""),
        (
            &roles.operator,
            vec!["dlq", "requeue", "--all", "--yes"],
            "",
        ),
    ];
    for (role, args, input) in &runs {
        let (code, stderr) = vantage_as(url, role, pw, args, input).await;
        if code != 0 {
            failures.push(format!(
                "{role}: vantage {} exited {code}: {stderr}",
                args.join(" ")
            ));
        }
    }
    owner.close().await;
    roles.drop_all().await;
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The daemon's and the producer's work under their own roles; `Err` names the step that failed.
async fn exercise_roles(
    url: &str,
    daemon: &str,
    producer: &str,
    operator: &str,
    password: &str,
) -> Result<(), String> {
    let step = |what: &'static str| move |e: sqlx::Error| format!("{what}: {e}");

    // The daemon checks its schema like `vantage run` does.
    let store = Store::connect(&StoreOptions::for_url(as_role(url, daemon, password)))
        .await
        .map_err(|e| format!("connect as the daemon role: {e}"))?;
    store
        .check_migrations()
        .await
        .map_err(|e| format!("check_migrations as the daemon role: {e}"))?;
    let pool = store.pool();
    let instance = Uuid::new_v4();
    let superuser: bool =
        sqlx::query_scalar("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            .fetch_one(pool)
            .await
            .map_err(step("read rolsuper"))?;
    if superuser {
        return Err("the daemon role is a superuser".into());
    }
    sqlx::query("SELECT register_perspective('orders', ARRAY['OrderPlaced'])")
        .execute(pool)
        .await
        .map_err(step("register_perspective"))?;
    sqlx::query("SELECT heartbeat(p_instance_id => $1, p_service_name => 'vantage', p_host_name => 'test', p_process_id => 1, p_version => '0')")
        .bind(instance)
        .execute(pool)
        .await
        .map_err(step("heartbeat"))?;
    let mut listener = sqlx::postgres::PgListener::connect_with(pool)
        .await
        .map_err(step("LISTEN connection"))?;
    listener
        .listen("vantage_work")
        .await
        .map_err(step("LISTEN vantage_work"))?;

    // A producer appends (function and plain INSERT); the fan-out runs with its privileges.
    let mut prod = PgConnection::connect_with(
        &StoreOptions::for_url(as_role(url, producer, password))
            .connect_options()
            .map_err(|e| e.to_string())?,
    )
    .await
    .map_err(step("connect as the producer role"))?;
    let stream = Uuid::new_v4();
    sqlx::query(
        r#"SELECT * FROM append_events($1, 0, '[{"event_type":"OrderPlaced","data":{"n":1}},{"event_type":"OrderPlaced","data":{"n":2}}]')"#,
    )
    .bind(stream)
    .fetch_all(&mut prod)
    .await
    .map_err(step("append_events as the producer"))?;
    sqlx::query("INSERT INTO wh_event_store (stream_id, stream_version, event_type) VALUES ($1, 3, 'OrderPlaced')")
        .bind(stream)
        .execute(&mut prod)
        .await
        .map_err(step("plain INSERT as the producer"))?;
    let _ = prod.close().await;
    tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .map_err(|_| "no vantage_work notification within 10 s".to_owned())?
        .map_err(step("NOTIFY"))?;

    // The daemon drains: claim, fetch, renew, complete, fail, release, dead-letter.
    sqlx::query("SELECT * FROM claim_orphaned_perspective_events(p_instance_id => $1, p_lease_seconds => 60, p_max_streams => 10, p_max_rows => 100)")
        .bind(instance)
        .fetch_all(pool)
        .await
        .map_err(step("claim_orphaned_perspective_events"))?;
    let rows = sqlx::query("SELECT event_work_id, event_type, event_data FROM get_stream_events(p_instance_id => $1, p_stream_ids => ARRAY[$2]::uuid[], p_lease_seconds => 60, p_max_rows => 100)")
        .bind(instance)
        .bind(stream)
        .fetch_all(pool)
        .await
        .map_err(step("get_stream_events"))?;
    let ids: Vec<Uuid> = rows.iter().map(|r| r.get("event_work_id")).collect();
    if ids.len() != 3 {
        return Err(format!(
            "expected 3 work rows leased to the daemon, got {}",
            ids.len()
        ));
    }
    let calls: [(&'static str, &str); 4] = [
        ("renew_leases", "SELECT renew_leases($1, $2, 60)"),
        (
            "complete_perspective_events",
            "SELECT complete_perspective_events($1, ($2)[1:1])",
        ),
        (
            "record_perspective_event_failure",
            "SELECT record_perspective_event_failure($1, ($2)[2], 'boom', 1)",
        ),
        (
            "release_unstarted_leases",
            "SELECT release_unstarted_leases($1, ($2)[3:3])",
        ),
    ];
    // Moved while still leased to the daemon (moves are fenced on the lease holder).
    let dead_letter: Option<Uuid> = sqlx::query_scalar(
        "SELECT move_to_dead_letters(gen_random_uuid(), 'wh_perspective_events', $1, 'MaxAttemptsExceeded', 'test', $2)",
    )
    .bind(ids[2])
    .bind(instance)
    .fetch_one(pool)
    .await
    .map_err(step("move_to_dead_letters"))?;
    let dead_letter = dead_letter.ok_or("move_to_dead_letters returned NULL")?;
    for (what, sql) in calls {
        sqlx::query(sql)
            .bind(instance)
            .bind(&ids)
            .execute(pool)
            .await
            .map_err(step(what))?;
    }

    // What the metrics sampler and `vantage status` read.
    for (what, sql) in [
        (
            "read wh_perspective_events",
            "SELECT count(*) FROM wh_perspective_events",
        ),
        (
            "read wh_dead_letters",
            "SELECT count(*) FROM wh_dead_letters WHERE status = 'exhausted'",
        ),
        (
            "read wh_dead_letter_history",
            "SELECT count(*) FROM wh_dead_letter_history",
        ),
        (
            "read wh_service_instances",
            "SELECT count(*) FROM wh_service_instances",
        ),
        (
            "read wh_perspectives",
            "SELECT count(*) FROM wh_perspectives",
        ),
        ("read wh_event_store", "SELECT count(*) FROM wh_event_store"),
    ] {
        sqlx::query(sql).fetch_one(pool).await.map_err(step(what))?;
    }

    // The sampler's chart history: upserted, trimmed and read (the console reads it too).
    for (what, sql) in [
        (
            "upsert wh_metric_samples",
            "INSERT INTO wh_metric_samples AS s (minute, perspective_name, applied, backlog) \
             VALUES (date_trunc('minute', now()), 'orders', 1, 0) \
             ON CONFLICT (minute, perspective_name) DO UPDATE SET applied = s.applied + EXCLUDED.applied",
        ),
        (
            "trim wh_metric_samples",
            "DELETE FROM wh_metric_samples WHERE minute < now() - interval '24 hours'",
        ),
        (
            "read wh_metric_samples",
            "SELECT count(*) FROM wh_metric_samples",
        ),
    ] {
        sqlx::query(sql).execute(pool).await.map_err(step(what))?;
    }

    // ... and nothing more: no DDL, no writing events.
    match sqlx::query("CREATE TABLE wh_not_allowed (x int)")
        .execute(pool)
        .await
    {
        Err(e) if is_permission_denied(&e) => {}
        other => return Err(format!("the daemon role could create a table: {other:?}")),
    }
    match sqlx::query("INSERT INTO wh_event_store (stream_id, stream_version, event_type) VALUES (gen_random_uuid(), 1, 'X')")
        .execute(pool)
        .await
    {
        Err(e) if is_permission_denied(&e) => {}
        other => return Err(format!("the daemon role could write events: {other:?}")),
    }

    // An operator requeues the dead letter.
    let mut op = PgConnection::connect_with(
        &StoreOptions::for_url(as_role(url, operator, password))
            .connect_options()
            .map_err(|e| e.to_string())?,
    )
    .await
    .map_err(step("connect as the operator role"))?;
    let requeued: bool = sqlx::query_scalar("SELECT requeue_dead_letter($1, 'test')")
        .bind(dead_letter)
        .fetch_one(&mut op)
        .await
        .map_err(step("requeue_dead_letter as the operator"))?;
    let _ = op.close().await;
    if !requeued {
        return Err("requeue_dead_letter returned false".into());
    }

    // Shutdown and cleanup.
    sqlx::query("SELECT cleanup_dead_instances(3600)")
        .execute(pool)
        .await
        .map_err(step("cleanup_dead_instances"))?;
    sqlx::query("SELECT deregister_instance($1)")
        .bind(instance)
        .execute(pool)
        .await
        .map_err(step("deregister_instance"))?;
    drop(listener);
    store.close().await;
    Ok(())
}
