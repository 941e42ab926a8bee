//! Configuration that cannot work is refused before anything is written (issue 8, "Configuration
//! accepted that cannot work", `?sslmode=bogus`, perspective names with control characters).
//!
//! Table-driven, against the real binary: each input (a TOML file, an environment variable or a
//! flag) is given to `config check` (no database) and to every command that reads the
//! configuration. Each exits 78 (the `dlq` commands 2, docs/cli.md "Exit codes") with one message
//! naming the key, the value as written and the layer it came from, never the password, and leaves
//! the database untouched.

use std::path::{Path, PathBuf};
use std::time::Duration;

use vantage::store::{Store, StoreOptions};

use crate::support;
use crate::support::process::{self, Output};

const EXIT_CONFIG: i32 = 78;
const EXIT_USAGE: i32 = 2;
const RUN_LIMIT: Duration = Duration::from_secs(60);
/// Never printed: every case's URL carries it.
const PASSWORD: &str = "pw-s3cret";

/// Where the bad value comes from.
enum Input {
    /// Lines added to the file (after `[database] url = …`, so they may open their own tables).
    Toml(&'static str),
    /// An environment variable.
    Env(&'static str, &'static str),
    /// The file without `url`, an environment variable (`PG*` are read only without a URL).
    EnvNoUrl(&'static str, &'static str),
    /// `--database-url` with this query string appended to the test database's URL.
    UrlQuery(&'static str),
}

struct Case {
    what: &'static str,
    input: Input,
    /// Every one must appear in stderr: key, value as written, origin, the bound.
    want: &'static [&'static str],
}

fn cases() -> Vec<Case> {
    use Input::*;
    vec![
        Case {
            what: "a poll interval the daemon cannot multiply",
            input: Toml("[worker]\npoll_interval = \"6000000000000000000s\""),
            want: &[
                "worker.poll_interval = \"6000000000000000000s\" (from ",
                "vantage.toml)",
                "at most 7d",
            ],
        },
        Case {
            what: "a heartbeat interval the daemon cannot multiply",
            input: Toml(
                "[orphans]\nheartbeat_interval = \"6000000000000000000s\"\nstale_after = \"6000000000000000001s\"",
            ),
            want: &[
                "orphans.heartbeat_interval = \"6000000000000000000s\" (from ",
                "at most 7d",
            ],
        },
        Case {
            what: "a huge duration from the environment",
            input: Env("VANTAGE__WORKER__SHUTDOWN_GRACE", "300000years"),
            want: &[
                "worker.shutdown_grace = \"300000years\" (from VANTAGE__WORKER__SHUTDOWN_GRACE)",
                "at most 7d",
            ],
        },
        Case {
            what: "a connect timeout of zero",
            input: Toml("[database]\nconnect_timeout = \"0s\""),
            want: &["database.connect_timeout = \"0s\" (from ", "greater than zero"],
        },
        Case {
            what: "a pool too small for the consumers",
            input: Toml("[database]\nmax_connections = 1"),
            want: &[
                "database.max_connections = 1 (from ",
                "at least 6 for worker.consumers = 4",
            ],
        },
        Case {
            what: "a pool too small for the consumers, set from the environment",
            input: Env("VANTAGE__WORKER__CONSUMERS", "16"),
            want: &[
                "database.max_connections = 10 (from the defaults)",
                "at least 18 for worker.consumers = 16",
            ],
        },
        Case {
            what: "consumers without end",
            input: Toml("[worker]\nconsumers = 2147483647"),
            want: &["worker.consumers = 2147483647 (from ", "at most 256"],
        },
        Case {
            what: "consumers beyond any integer",
            input: Toml("[worker]\nconsumers = 99999999999999999999"),
            want: &["worker.consumers = 99999999999999999999 (from ", "vantage.toml)"],
        },
        Case {
            what: "a lease beyond SQL seconds, echoed as written",
            input: Toml("[worker]\nlease = \"100000000000s\""),
            want: &["worker.lease = \"100000000000s\" (from ", "at most 7d"],
        },
        Case {
            what: "information_schema",
            input: Toml("[database]\nschema = \"information_schema\""),
            want: &["database.schema = \"information_schema\" (from ", "system schema"],
        },
        Case {
            what: "pg_catalog",
            input: Toml("[database]\nschema = \"pg_catalog\""),
            want: &["database.schema = \"pg_catalog\" (from ", "system schema"],
        },
        Case {
            what: "pg_toast",
            input: Env("VANTAGE__DATABASE__SCHEMA", "pg_toast"),
            want: &[
                "database.schema = \"pg_toast\" (from VANTAGE__DATABASE__SCHEMA)",
                "system schema",
            ],
        },
        Case {
            what: "pg_temp",
            input: Toml("[database]\nschema = \"pg_temp_3\""),
            want: &["database.schema = \"pg_temp_3\" (from ", "system schema"],
        },
        Case {
            what: "a log filter the logger refuses",
            input: Toml("[log]\nlevel = \"info,[[[\""),
            want: &["log.level = \"info,[[[\" (from ", "vantage.toml)"],
        },
        Case {
            what: "an OTLP endpoint that is not http(s)",
            input: Toml("[telemetry]\notlp_endpoint = \"ftp://collector:4318\""),
            want: &[
                "telemetry.otlp_endpoint = \"ftp://collector:4318\" (from ",
                "http:// or https://",
            ],
        },
        Case {
            what: "an OTLP protocol this build does not speak",
            input: Env("VANTAGE__TELEMETRY__PROTOCOL", "grpc"),
            want: &[
                "telemetry.protocol = \"grpc\" (from VANTAGE__TELEMETRY__PROTOCOL)",
                "http/protobuf",
            ],
        },
        Case {
            what: "PGSSLMODE garbage",
            input: EnvNoUrl("PGSSLMODE", "garbage"),
            want: &[
                "PGSSLMODE = \"garbage\" (from the environment)",
                "verify-full",
            ],
        },
        Case {
            what: "PGPORT not a number",
            input: EnvNoUrl("PGPORT", "abc"),
            want: &["PGPORT = \"abc\" (from the environment)", "port"],
        },
        Case {
            what: "an sslmode PostgreSQL does not know",
            input: UrlQuery("?sslmode=bogus"),
            want: &[
                "database.url = \"postgres://",
                "sslmode=bogus\" (from --database-url)",
                "sslmode",
            ],
        },
        Case {
            what: "a perspective name with a control character",
            input: Toml(
                "[[perspectives]]\nname = \"orders\\u0007\"\nevents = [\"A\"]\n[perspectives.sql]\nA = \"SELECT 1\"",
            ),
            want: &["perspectives[0].name = \"orders\\u{7}\" (from ", "control character"],
        },
        Case {
            what: "a quarantine that is not N in a duration",
            input: Toml(
                "[[perspectives]]\nname = \"orders\"\nevents = [\"A\"]\nquarantine_after = \"50 in 5 minutes or so\"\n[perspectives.sql]\nA = \"SELECT 1\"",
            ),
            want: &[
                "perspectives[0].quarantine_after = \"50 in 5 minutes or so\" (from ",
                "vantage.toml)",
                "expected \"N in DURATION\", such as \"50 in 5m\"",
            ],
        },
        Case {
            what: "a quarantine window of zero",
            input: Toml(
                "[[perspectives]]\nname = \"orders\"\nevents = [\"A\"]\nquarantine_after = \"3 in 0s\"\n[perspectives.sql]\nA = \"SELECT 1\"",
            ),
            want: &[
                "perspectives[0].quarantine_after = \"3 in 0s\" (from ",
                "more than zero",
            ],
        },
    ]
}

/// The test database's URL with a password added (trust authentication ignores it).
fn with_password(url: &str) -> String {
    let mut u = url::Url::parse(url).unwrap();
    u.set_password(Some(PASSWORD)).unwrap();
    u.to_string()
}

struct Prepared {
    config: PathBuf,
    args: Vec<String>,
    env: Vec<(&'static str, &'static str)>,
}

fn prepare(dir: &Path, url: &str, case: &Case) -> Prepared {
    let config = dir.join("vantage.toml");
    let url_line = format!("[database]\nurl = \"{url}\"\n");
    let (text, args, env) = match &case.input {
        Input::Toml(extra) => {
            // A `[database]` of the case merges with ours: put its keys under our header.
            let extra = extra.strip_prefix("[database]\n").map_or_else(
                || format!("{url_line}{extra}\n"),
                |keys| format!("{url_line}{keys}\n"),
            );
            (extra, vec![], vec![])
        }
        Input::Env(var, value) => (url_line, vec![], vec![(*var, *value)]),
        Input::EnvNoUrl(var, value) => (String::new(), vec![], vec![(*var, *value)]),
        Input::UrlQuery(query) => (
            url_line,
            vec!["--database-url".to_owned(), format!("{url}{query}")],
            vec![],
        ),
    };
    std::fs::write(&config, text).unwrap();
    Prepared { config, args, env }
}

async fn vantage(dir: &Path, p: &Prepared, command: &[&str]) -> Output {
    let mut all = vec!["--config", p.config.to_str().unwrap()];
    all.extend(p.args.iter().map(String::as_str));
    all.extend_from_slice(command);
    let mut env = vec![("VANTAGE__HTTP__LISTEN", "127.0.0.1:0")];
    env.extend(p.env.iter().copied());
    let out = process::run(process::vantage(dir, &all, &env), RUN_LIMIT).await;
    out.assert_no_panic();
    out
}

fn assert_refused(out: &Output, case: &Case, command: &str, code: i32) {
    let label = format!("{} / vantage {command}", case.what);
    assert_eq!(out.code, Some(code), "{label}: {out:#?}");
    // Under --json the message is the envelope's `data.error` on stdout, else stderr alone.
    let message = if command.contains("--json") {
        let envelope: serde_json::Value = serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("{label}: stdout is not one JSON envelope ({e}): {out:#?}"));
        envelope["data"]["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    } else {
        assert!(out.stdout.is_empty(), "{label}: {out:#?}");
        out.stderr.clone()
    };
    for want in case.want {
        assert!(
            message.contains(want),
            "{label}: the message should contain {want:?}: {out:#?}"
        );
    }
    // One message (`run` prefixes its name).
    assert_eq!(
        message.matches("invalid configuration: ").count(),
        1,
        "{label}: {out:#?}"
    );
    assert!(
        !out.stderr.contains(PASSWORD) && !out.stdout.contains(PASSWORD),
        "{label}: {out:#?}"
    );
}

/// Every case, every command: 78 (dlq: 2), the key, value as written and origin named, and
/// nothing written to the database.
#[tokio::test]
async fn configuration_that_cannot_work_is_refused_by_every_command() {
    let db = support::fresh_database().await;
    let url = with_password(&db.url);
    let dir = tempfile::tempdir().unwrap();
    for case in cases() {
        let prepared = prepare(dir.path(), &url, &case);
        for (command, code) in [
            (&["config", "check"][..], EXIT_CONFIG),
            (&["run"], EXIT_CONFIG),
            (&["migrate"], EXIT_CONFIG),
            (&["status"], EXIT_CONFIG),
            (&["perspectives", "list"], EXIT_CONFIG),
            (&["append"], EXIT_CONFIG),
            (&["dlq", "list"], EXIT_USAGE),
            (&["dlq", "list", "--json"], EXIT_USAGE),
        ] {
            let out = vantage(dir.path(), &prepared, command).await;
            assert_refused(&out, &case, &command.join(" "), code);
        }
    }
    // Nothing written: no command got as far as creating the schema.
    let store = Store::connect(&StoreOptions::for_url(&db.url))
        .await
        .unwrap();
    let schemas = process::scalar(
        &store,
        "SELECT count(*) FROM pg_namespace WHERE nspname = 'vantage'",
    )
    .await;
    assert_eq!(schemas, 0, "a refused configuration created the schema");
}

/// The bounds are generous enough for every shipped configuration and for the documented
/// maxima themselves.
#[tokio::test]
async fn the_bounds_themselves_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vantage.toml");
    std::fs::write(
        &config,
        "[database]\nurl = \"postgres://u:pw@h:5432/db?sslmode=require\"\nschema = \"pgx_read_models\"\n\
         max_connections = 258\nconnect_timeout = \"7d\"\n\
         [worker]\nconsumers = 256\nlease = \"7d\"\npoll_interval = \"7d\"\nshutdown_grace = \"7d\"\n\
         retry_backoff_max = \"7d\"\n\
         [orphans]\nheartbeat_interval = \"6d\"\nstale_after = \"7d\"\n\
         [cooldown]\nttl = \"7d\"\n[log]\nlevel = \"info,vantage=debug,sqlx[query]=warn\"\n",
    )
    .unwrap();
    let out = process::run(
        process::vantage(
            dir.path(),
            &["--config", config.to_str().unwrap(), "config", "check"],
            &[("PGSSLMODE", "bogus-but-unused"), ("PGPORT", "unused")],
        ),
        RUN_LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(0), "{out:#?}");
}

/// libpq's Unix-socket spelling, `postgres://user:password@/db?host=/dir`, is a valid URL:
/// `config check` accepts it (and hides the password), and `migrate` connects through it.
#[tokio::test]
async fn a_unix_socket_url_is_accepted_and_connects() {
    let dir = tempfile::tempdir().unwrap();
    let out = process::run(
        process::vantage(
            dir.path(),
            &[
                "--database-url",
                &format!("postgres://u:{PASSWORD}@/db?host=/tmp"),
                "config",
                "check",
            ],
            &[],
        ),
        RUN_LIMIT,
    )
    .await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    assert!(!out.stdout.contains(PASSWORD), "{out:#?}");
    assert!(
        out.stdout.contains("host=/tmp") || out.stdout.contains("host=%2Ftmp"),
        "{out:#?}"
    );

    // Through the throwaway server's socket directory, when the tests started one.
    let Some(server) = support::throwaway_server() else {
        return;
    };
    let db = support::fresh_database().await;
    let socket_dir = server.data_dir().parent().unwrap().join("socket");
    let url = format!(
        "postgres://{}:{PASSWORD}@/{}?host={}&port={}",
        server.user(),
        db.name,
        socket_dir.display(),
        server.port()
    );
    let out = process::run(
        process::vantage(dir.path(), &["--database-url", &url, "migrate"], &[]),
        RUN_LIMIT,
    )
    .await;
    out.assert_no_panic();
    assert_eq!(out.code, Some(0), "{out:#?}");
    let store = Store::connect(&StoreOptions::for_url(&db.url))
        .await
        .unwrap();
    let schemas = process::scalar(
        &store,
        "SELECT count(*) FROM pg_namespace WHERE nspname = 'vantage'",
    )
    .await;
    assert_eq!(schemas, 1, "migrate through the socket created the schema");
}

/// Item 15 (issue 19): one rule for the same invalid configuration from every operator command — a
/// file that is not TOML, and one with a value of the wrong type: 78 (EX_CONFIG, docs/cli.md "Exit
/// codes"), except the `vantage dlq` commands, whose exit codes docs/cli.md fixes (bad
/// configuration is 2). Each says `invalid configuration: ` once, names the file, prints nothing on
/// stdout (under `--json`, the envelope), and connects to nothing.
#[tokio::test]
async fn the_same_invalid_configuration_exits_by_one_rule_from_every_operator_command() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vantage.toml");
    let commands: &[(&[&str], i32)] = &[
        (&["config", "check"], EXIT_CONFIG),
        (&["run"], EXIT_CONFIG),
        (&["migrate"], EXIT_CONFIG),
        (&["status"], EXIT_CONFIG),
        (&["status", "--json"], EXIT_CONFIG),
        (&["status", "--blocked"], EXIT_CONFIG),
        (&["perspectives", "list"], EXIT_CONFIG),
        (&["perspectives", "rebuild", "p", "--yes"], EXIT_CONFIG),
        (&["perspectives", "pause", "p"], EXIT_CONFIG),
        (&["perspectives", "resume", "p"], EXIT_CONFIG),
        (&["append"], EXIT_CONFIG),
        (&["console"], EXIT_CONFIG),
        (&["dlq", "list"], EXIT_USAGE),
        (&["dlq", "list", "--json"], EXIT_USAGE),
        (&["dlq", "groups"], EXIT_USAGE),
        (&["dlq", "inspect", "1"], EXIT_USAGE),
        (&["dlq", "replay", "1", "--yes"], EXIT_USAGE),
        (&["dlq", "replay", "1", "--dry-run"], EXIT_USAGE),
        (&["dlq", "purge", "1", "--yes"], EXIT_USAGE),
        (&["dlq", "requeue", "1", "--yes"], EXIT_USAGE),
        (&["dlq", "requeue", "--all", "--yes", "--json"], EXIT_USAGE),
    ];
    // A database nobody listens on: a command that got past the configuration would say so.
    let url = "postgres://u@127.0.0.1:1/nowhere";
    for (what, text, want) in [
        (
            "not TOML",
            format!("[database\nurl = \"{url}\"\n"),
            "is not valid TOML",
        ),
        (
            "a value of the wrong type",
            format!("[database]\nurl = \"{url}\"\n[worker]\nconsumers = \"many\"\n"),
            "worker.consumers = \"many\" (from ",
        ),
    ] {
        std::fs::write(&config, &text).unwrap();
        for (command, code) in commands {
            let mut args = vec!["--config", config.to_str().unwrap()];
            args.extend_from_slice(command);
            let out = process::run(
                process::vantage(
                    dir.path(),
                    &args,
                    &[("VANTAGE__HTTP__LISTEN", "127.0.0.1:0")],
                ),
                RUN_LIMIT,
            )
            .await;
            out.assert_no_panic();
            let label = format!("{what} / vantage {}", command.join(" "));
            assert_eq!(out.code, Some(*code), "{label}: {out:#?}");
            let message = if command.contains(&"--json") {
                let envelope: serde_json::Value = serde_json::from_str(&out.stdout)
                    .unwrap_or_else(|e| panic!("{label}: not one JSON envelope ({e}): {out:#?}"));
                assert_eq!(envelope["status"], "error", "{label}");
                envelope["data"]["error"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            } else {
                assert!(out.stdout.is_empty(), "{label}: {out:#?}");
                out.stderr.clone()
            };
            assert_eq!(
                message.matches("invalid configuration: ").count(),
                1,
                "{label}: {out:#?}"
            );
            assert!(message.contains(want), "{label}: {out:#?}");
            assert!(message.contains("vantage.toml"), "{label}: {out:#?}");
        }
    }
}
