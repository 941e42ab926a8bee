//! Unit tests of loading, layering, messages and redaction (moved with the code from config.rs).

use super::secret::scrub_secrets;
use super::*;
use std::io::Write;
use std::time::Duration;

const SECRET_URL: &str = "postgres://u:secret@h/db";

fn env(vars: &[(&str, &str)]) -> HashMap<String, String> {
    vars.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn file(contents: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    f.write_all(contents.as_bytes()).unwrap();
    f
}

fn opts(f: &tempfile::NamedTempFile) -> LoadOptions {
    LoadOptions {
        config_path: Some(f.path().to_path_buf()),
        ..LoadOptions::default()
    }
}

fn err(toml: &str) -> String {
    Settings::from_toml_str(toml).unwrap_err().to_string()
}

#[test]
fn defaults_are_as_specified() {
    let s = Settings::from_toml_str("").unwrap();
    assert_eq!(s, Settings::default());
    assert_eq!(s.database.url, None);
    assert_eq!(s.database.schema, "vantage");
    assert_eq!(s.database.max_connections, 10);
    assert!(s.database.auto_migrate);
    assert_eq!(s.database.connect_timeout, Duration::from_secs(30));
    assert_eq!(s.worker.consumers, 4);
    assert_eq!(s.worker.batch_size, 500);
    assert_eq!(s.worker.max_streams_per_claim, 100);
    assert_eq!(s.worker.lease, Duration::from_secs(60));
    assert_eq!(s.worker.poll_interval, Duration::from_secs(1));
    assert_eq!(s.worker.max_perspective_event_attempts, Some(10));
    assert_eq!(s.worker.retry_backoff_base, Duration::from_secs(1));
    assert_eq!(s.worker.retry_backoff_max, Duration::from_secs(300));
    assert_eq!(s.worker.shutdown_grace, Duration::from_secs(30));
    assert!(s.cooldown.enabled);
    assert_eq!(s.cooldown.ttl, Duration::from_secs(300));
    assert_eq!(s.cooldown.max_entries, 100_000);
    assert_eq!(s.orphans.heartbeat_interval, Duration::from_secs(10));
    assert_eq!(s.orphans.stale_after, Duration::from_secs(30));
    assert_eq!(s.http.listen, "127.0.0.1:9464".parse().unwrap());
    assert_eq!(s.log.format, LogFormat::Text);
    assert_eq!(s.log.level, "info");
    assert!(s.perspectives.is_empty());
}

#[test]
fn file_overrides_defaults() {
    let s = Settings::from_toml_str(
        r#"
        [database]
        url = "postgres://h/db"
        schema = "read_models"
        [worker]
        consumers = 2
        lease = "90s"
        retry_backoff_base = "250ms"
        [log]
        format = "json"
        "#,
    )
    .unwrap();
    assert_eq!(s.database.url.unwrap().expose(), "postgres://h/db");
    assert_eq!(s.database.schema, "read_models");
    assert_eq!(s.worker.consumers, 2);
    assert_eq!(s.worker.lease, Duration::from_secs(90));
    assert_eq!(s.worker.retry_backoff_base, Duration::from_millis(250));
    assert_eq!(s.log.format, LogFormat::Json);
    // Untouched keys keep their defaults.
    assert_eq!(s.worker.batch_size, 500);
    assert_eq!(s.database.max_connections, 10);
}

#[test]
fn spec_perspective_example_parses() {
    let s = Settings::from_toml_str(
        r#"
        [[perspectives]]
        name = "order_summary"
        events = ["OrderPlaced", "OrderShipped"]
        reset = "TRUNCATE order_summary"
        [perspectives.sql]
        OrderPlaced  = "INSERT INTO order_summary (order_id) VALUES (($1->>'order_id')::uuid)"
        OrderShipped = "UPDATE order_summary SET status = 'shipped'"

        [[perspectives]]
        name = "audit"
        events = ["*"]
        [perspectives.sql]
        "*" = "INSERT INTO audit_log (event_id, event_type) VALUES ($3, $4)"
        "#,
    )
    .unwrap();
    assert_eq!(s.perspectives.len(), 2);
    let p = &s.perspectives[0];
    assert_eq!(p.name, "order_summary");
    assert_eq!(p.events, ["OrderPlaced", "OrderShipped"]);
    assert_eq!(p.reset.as_deref(), Some("TRUNCATE order_summary"));
    assert!(p.sql["OrderPlaced"].starts_with("INSERT"));
    assert!(p.sql["OrderShipped"].starts_with("UPDATE"));
    assert_eq!(s.perspectives[1].events, ["*"]);
    assert_eq!(s.perspectives[1].sql.keys().collect::<Vec<_>>(), ["*"]);
}

#[test]
fn env_overrides_file_and_database_url_sits_between() {
    let f =
        file("[worker]\nconsumers = 2\nbatch_size = 7\n[database]\nurl = \"postgres://file/db\"\n");
    let o = opts(&f);

    let s = Settings::load_with_env(&o, &env(&[])).unwrap();
    assert_eq!(s.worker.consumers, 2);
    assert_eq!(s.database.url.unwrap().expose(), "postgres://file/db");

    let s = Settings::load_with_env(
        &o,
        &env(&[
            ("VANTAGE__WORKER__CONSUMERS", "8"),
            ("VANTAGE__WORKER__LEASE", "2m"),
            ("VANTAGE__COOLDOWN__ENABLED", "false"),
            ("DATABASE_URL", "postgres://env/db"),
            ("UNRELATED", "x"),
        ]),
    )
    .unwrap();
    assert_eq!(s.worker.consumers, 8);
    assert_eq!(s.worker.batch_size, 7);
    assert_eq!(s.worker.lease, Duration::from_secs(120));
    assert!(!s.cooldown.enabled);
    assert_eq!(s.database.url.unwrap().expose(), "postgres://env/db");

    let s = Settings::load_with_env(
        &o,
        &env(&[
            ("DATABASE_URL", "postgres://env/db"),
            ("VANTAGE__DATABASE__URL", "postgres://vantage/db"),
        ]),
    )
    .unwrap();
    assert_eq!(s.database.url.unwrap().expose(), "postgres://vantage/db");

    // Empty variables count as unset.
    let s = Settings::load_with_env(
        &o,
        &env(&[("VANTAGE__WORKER__CONSUMERS", ""), ("DATABASE_URL", "")]),
    )
    .unwrap();
    assert_eq!(s.worker.consumers, 2);
    assert_eq!(s.database.url.unwrap().expose(), "postgres://file/db");
}

#[test]
fn overrides_beat_env() {
    // 16 consumers need 18 connections (see `MIN_EXTRA_CONNECTIONS`).
    let f = file("[worker]\nconsumers = 2\n[database]\nmax_connections = 18\n");
    let o = LoadOptions {
        overrides: vec![("worker.consumers".into(), "16".into())],
        database_url: Some("postgres://flag/db".into()),
        ..opts(&f)
    };
    let s = Settings::load_with_env(
        &o,
        &env(&[
            ("VANTAGE__WORKER__CONSUMERS", "8"),
            ("VANTAGE__DATABASE__URL", "postgres://vantage/db"),
        ]),
    )
    .unwrap();
    assert_eq!(s.worker.consumers, 16);
    assert_eq!(s.database.url.unwrap().expose(), "postgres://flag/db");
}

#[test]
fn no_url_anywhere_stays_none() {
    let f = file("");
    let s = Settings::load_with_env(&opts(&f), &env(&[("PGHOST", "db")])).unwrap();
    assert_eq!(s.database.url, None);
}

#[test]
fn missing_explicit_file_is_an_error() {
    let o = LoadOptions {
        config_path: Some("/nonexistent/vantage.toml".into()),
        ..LoadOptions::default()
    };
    let e = Settings::load_with_env(&o, &env(&[])).unwrap_err();
    assert!(matches!(e, ConfigError::FileNotFound { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/vantage.toml"));
}

#[test]
fn attempts_off_and_numbers_from_every_layer() {
    let s = Settings::from_toml_str("[worker]\nmax_perspective_event_attempts = \"off\"").unwrap();
    assert_eq!(s.worker.max_perspective_event_attempts, None);
    let s = Settings::from_toml_str("[worker]\nmax_perspective_event_attempts = 3").unwrap();
    assert_eq!(s.worker.max_perspective_event_attempts, Some(3));

    let f = file("");
    for (raw, want) in [
        ("off", None),
        ("OFF", None),
        ("10", Some(10)),
        ("1", Some(1)),
    ] {
        let s = Settings::load_with_env(
            &opts(&f),
            &env(&[("VANTAGE__WORKER__MAX_PERSPECTIVE_EVENT_ATTEMPTS", raw)]),
        )
        .unwrap();
        assert_eq!(s.worker.max_perspective_event_attempts, want, "{raw}");
    }
    for bad in ["0", "-1", "never", "1.5"] {
        let e = Settings::load_with_env(
            &opts(&f),
            &env(&[("VANTAGE__WORKER__MAX_PERSPECTIVE_EVENT_ATTEMPTS", bad)]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("worker.max_perspective_event_attempts")
                && e.contains("VANTAGE__WORKER__MAX_PERSPECTIVE_EVENT_ATTEMPTS"),
            "{e}"
        );
    }
    assert!(err("[worker]\nmax_perspective_event_attempts = 0")
        .contains("expected a positive integer or \"off\""));
}

#[test]
fn bad_values_name_their_key() {
    assert_eq!(ConfigError::EXIT_CODE, 78);
    let f = file("");
    let e = Settings::load_with_env(&opts(&f), &env(&[("VANTAGE__WORKER__CONSUMERS", "abc")]))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "invalid configuration: worker.consumers = \"abc\" (from VANTAGE__WORKER__CONSUMERS): expected a positive integer"
    );

    assert_eq!(
        err("[worker]\nconsumers = \"abc\""),
        "invalid configuration: worker.consumers = \"abc\": expected a positive integer"
    );

    let cases = [
        ("[worker]\nconsumers = 0", "worker.consumers = 0"),
        ("[worker]\nbatch_size = 0", "worker.batch_size = 0"),
        (
            "[worker]\nmax_streams_per_claim = -3",
            "worker.max_streams_per_claim = -3",
        ),
        ("[worker]\nconsumers = 1.5", "worker.consumers = 1.5"),
        ("[worker]\nlease = \"500ms\"", "worker.lease = \"500ms\""),
        ("[worker]\nlease = 60", "worker.lease = 60"),
        (
            "[worker]\npoll_interval = \"soon\"",
            "worker.poll_interval = \"soon\"",
        ),
        (
            "[worker]\nretry_backoff_base = \"10m\"",
            "worker.retry_backoff_base = \"10m\"",
        ),
        (
            "[orphans]\nstale_after = \"10s\"",
            "orphans.stale_after = \"10s\"",
        ),
        ("[cooldown]\nmax_entries = 0", "cooldown.max_entries = 0"),
        (
            "[cooldown]\nenabled = \"yes\"",
            "cooldown.enabled = \"yes\"",
        ),
        (
            "[database]\nschema = \"Vantage\"",
            "database.schema = \"Vantage\"",
        ),
        (
            "[database]\nschema = \"1abc\"",
            "database.schema = \"1abc\"",
        ),
        (
            "[database]\nschema = \"a;drop\"",
            "database.schema = \"a;drop\"",
        ),
        (
            "[database]\nurl = \"mysql://h/db\"",
            "database.url = \"mysql://h/db\"",
        ),
        (
            "[http]\nlisten = \"localhost\"",
            "http.listen = \"localhost\"",
        ),
        ("[log]\nformat = \"xml\"", "log.format = \"xml\""),
        ("[log]\nlevel = \"inof\"", "log.level = \"inof\""),
        ("worker = 3", "worker = 3"),
        ("perspectives = 3", "perspectives = 3"),
    ];
    for (toml, want) in cases {
        let e = err(toml);
        assert!(e.starts_with("invalid configuration: "), "{e}");
        assert!(e.contains(want), "{toml:?} gave {e}");
    }
    let long = format!("[database]\nschema = \"{}\"", "a".repeat(64));
    assert!(err(&long).contains("database.schema"));
    assert!(
        Settings::from_toml_str(&format!("[database]\nschema = \"{}\"", "a".repeat(63))).is_ok()
    );
    // A disabled cache may have any size.
    assert!(Settings::from_toml_str("[cooldown]\nenabled = false\nmax_entries = 0").is_ok());
    // Directives are left to the logger.
    assert!(Settings::from_toml_str("[log]\nlevel = \"info,vantage=debug\"").is_ok());
}

#[test]
fn unknown_keys_are_errors() {
    let e = err("[worker]\nconsumer = 3");
    assert!(
        e.contains("unknown key worker.consumer") && e.contains("consumers"),
        "{e}"
    );
    assert!(err("[workers]\nconsumers = 3").contains("unknown key workers"));
    assert!(
        err("[[perspectives]]\nname = \"a\"\nevents = [\"*\"]\ntable = \"x\"")
            .contains("unknown key perspectives[0].table")
    );

    let f = file("");
    let e = Settings::load_with_env(&opts(&f), &env(&[("VANTAGE__WORKER__CONSUMER", "3")]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("worker.consumer") && e.contains("VANTAGE__WORKER__CONSUMER"),
        "{e}"
    );

    let e = Settings::load_with_env(&opts(&f), &env(&[("VANTAGE__PERSPECTIVES__0__NAME", "x")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("only be configured in the file"), "{e}");

    let o = LoadOptions {
        overrides: vec![("worker.nope".into(), "1".into())],
        ..opts(&f)
    };
    let e = Settings::load_with_env(&o, &env(&[]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown key worker.nope (from an override)"),
        "{e}"
    );
}

#[test]
fn perspective_rules() {
    let base = "[[perspectives]]\nname = \"p\"\n";
    let e = err(&format!(
        "{base}events = [\"A\"]\n[perspectives.sql]\nA = \"select 1\"\nB = \"select 2\""
    ));
    assert!(
        e.contains("perspectives[0].sql.B") && e.contains("not listed"),
        "{e}"
    );
    let e = err(&format!(
        "{base}events = [\"A\", \"B\"]\n[perspectives.sql]\nA = \"select 1\""
    ));
    assert!(
        e.contains("perspectives[0].sql") && e.contains("'B'"),
        "{e}"
    );
    let e = err("[[perspectives]]\nevents = [\"*\"]");
    assert!(e.contains("perspectives[0].name: missing"), "{e}");
    let e = err("[[perspectives]]\nname = \"\"\nevents = [\"*\"]");
    assert!(e.contains("perspectives[0].name = \"\""), "{e}");
    let e = err(&format!(
        "{base}events = [\"*\"]\n[[perspectives]]\nname = \"p\"\nevents = [\"*\"]"
    ));
    assert!(
        e.contains("perspectives[1].name = \"p\"") && e.contains("perspectives[0]"),
        "{e}"
    );
    let e = err(&format!("{base}events = []"));
    assert!(e.contains("perspectives[0].events"), "{e}");
    let e = err(&format!("{base}events = \"A\""));
    assert!(e.contains("perspectives[0].events = \"A\""), "{e}");
    // With "*", statements for any type are fine, and the "*" catch-all is required: an
    // event without a statement would be completed without running anything.
    assert!(Settings::from_toml_str(&format!(
        "{base}events = [\"*\"]\n[perspectives.sql]\nAnything = \"select 1\"\n\"*\" = \"select 2\""
    ))
    .is_ok());
    for toml in [
        format!("{base}events = [\"*\"]"),
        format!("{base}events = [\"*\"]\n[perspectives.sql]\nAnything = \"select 1\""),
    ] {
        assert_eq!(
            err(&toml),
            "invalid configuration: perspectives[0].sql: perspective 'p', event type '*': it \
             subscribes to every event type but has no \"*\" statement, so events without a \
             statement of their own would be completed without running anything (add the \
             catch-all \"*\" = \"...\" to its [perspectives.sql])",
            "{toml}"
        );
    }
    // A "*" statement without the "*" subscription names an unlisted type.
    let e = err(&format!(
        "{base}events = [\"A\"]\n[perspectives.sql]\nA = \"select 1\"\n\"*\" = \"select 2\""
    ));
    assert!(
        e.contains("perspectives[0].sql.*") && e.contains("not listed"),
        "{e}"
    );
    // Statements that can never run are refused before any database is involved.
    let cases = [
        ("A = \"select $8\"", "perspectives[0].sql.A: perspective 'p', event type 'A': the statement uses parameter $8, but only $1 to $7 are bound"),
        ("A = \"select '$8', $7 -- $9\"", ""),
        ("A = \" /* done */ COMMIT\"", "perspectives[0].sql.A: perspective 'p', event type 'A': the statement starts with COMMIT, which ends or controls the transaction"),
        ("A = \"rollback\"", "perspectives[0].sql.A: perspective 'p', event type 'A': the statement starts with ROLLBACK"),
    ];
    for (sql, want) in cases {
        let toml = format!("{base}events = [\"A\"]\n[perspectives.sql]\n{sql}");
        if want.is_empty() {
            assert!(Settings::from_toml_str(&toml).is_ok(), "{toml}");
        } else {
            let e = err(&toml);
            assert!(
                e.starts_with(&format!("invalid configuration: {want}")),
                "{toml}: {e}"
            );
        }
    }
    let e = err(&format!(
        "{base}events = [\"A\"]\nreset = \"delete from t where id = $1\"\n[perspectives.sql]\nA = \"select 1\""
    ));
    assert!(
        e.starts_with("invalid configuration: perspectives[0].reset: perspective 'p', reset statement: the statement uses parameter $1, but reset runs with no parameters bound"),
        "{e}"
    );
    let e = err(&format!(
        "{base}events = [\"A\"]\nreset = \"COMMIT\"\n[perspectives.sql]\nA = \"select 1\""
    ));
    assert!(
        e.contains("perspectives[0].reset") && e.contains("COMMIT"),
        "{e}"
    );
    // Event types keep their case and may contain dots.
    let s = Settings::from_toml_str(&format!(
        "{base}events = [\"Orders.Placed\"]\n[perspectives.sql]\n\"Orders.Placed\" = \"select 1\""
    ))
    .unwrap();
    assert!(s.perspectives[0].sql.contains_key("Orders.Placed"));
}

#[test]
fn quarantine_after_is_n_in_a_duration() {
    let base = "[[perspectives]]\nname = \"p\"\nevents = [\"A\"]\n";
    let sql = "[perspectives.sql]\nA = \"select 1\"\n";
    let parse = |value: &str| {
        Settings::from_toml_str(&format!("{base}quarantine_after = {value}\n{sql}"))
            .map(|s| s.perspectives[0].quarantine_after)
    };
    assert_eq!(
        parse("\"50 in 5m\"").unwrap(),
        Some(QuarantineAfter {
            dead_letters: 50,
            window: Duration::from_secs(300)
        })
    );
    let q = parse("\"  3   in  1m 30s \"").unwrap().unwrap();
    assert_eq!((q.dead_letters, q.window), (3, Duration::from_secs(90)));
    assert_eq!(q.to_string(), "3 in 1m 30s");
    assert_eq!(q.reason(), "quarantined: 3 dead letters in 1m 30s");
    assert_eq!(parse("\"1 in 7d\"").unwrap().unwrap().dead_letters, 1);
    // Absent: off.
    let s = Settings::from_toml_str(&format!("{base}{sql}")).unwrap();
    assert_eq!(s.perspectives[0].quarantine_after, None);

    for bad in [
        "\"fifty in 5m\"",
        "\"0 in 5m\"",
        "\"-1 in 5m\"",
        "\"50 in 0s\"",
        "\"50 in 8d\"",
        "\"50 in 5\"",
        "\"50 per 5m\"",
        "\"50\"",
        "\"2147483648 in 5m\"",
        "\"\"",
        "50",
        "true",
    ] {
        let e = parse(bad).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("invalid configuration: perspectives[0].quarantine_after = {bad}: expected \"N in DURATION\", such as \"50 in 5m\"")),
            "{bad}: {e}"
        );
        assert!(e.contains("at most 7d"), "{bad}: {e}");
    }
}

#[test]
fn redacted_toml_hides_the_password_and_round_trips() {
    let s = Settings::from_toml_str(&format!(
        r#"
        [database]
        url = "{SECRET_URL}"
        [worker]
        max_perspective_event_attempts = "off"
        retry_backoff_max = "1m 30s 250ms"
        [[perspectives]]
        name = "order_summary"
        events = ["OrderPlaced", "Odd \"type\"\n"]
        reset = "TRUNCATE order_summary"
        quarantine_after = "50 in 1h 30s"
        [perspectives.sql]
        OrderPlaced = "INSERT INTO t VALUES ($1->>'id')"
        "Odd \"type\"\n" = "SELECT '\\'"
        "#
    ))
    .unwrap();
    let out = s.redacted_toml();
    assert!(!out.contains("secret"), "{out}");
    assert!(out.contains("quarantine_after = \"50 in 1h 30s\""), "{out}");
    assert!(out.contains("url = \"postgres://u:***@h/db\""), "{out}");

    let back = Settings::from_toml_str(&out).unwrap();
    assert_eq!(
        back.database.url.as_ref().unwrap().expose(),
        "postgres://u:***@h/db"
    );
    let mut expected = s.clone();
    expected.database.url = back.database.url.clone();
    assert_eq!(back, expected);

    let defaults = Settings::default().redacted_toml();
    assert!(defaults.contains("# url is not set"));
    assert_eq!(
        Settings::from_toml_str(&defaults).unwrap(),
        Settings::default()
    );
}

#[test]
fn password_never_shows_in_debug_or_errors() {
    let s = Settings::from_toml_str(&format!("[database]\nurl = \"{SECRET_URL}\"")).unwrap();
    let url = s.database.url.clone().unwrap();
    assert_eq!(url.expose(), SECRET_URL);
    assert!(!format!("{s:?}").contains("secret"));
    assert!(!format!("{s:#?}").contains("secret"));
    assert!(!url.to_string().contains("secret"));

    let q = DatabaseUrl::new("postgres://h/db?sslmode=require&password=secret");
    assert!(!q.redacted().contains("secret") && q.redacted().contains("sslmode=require"));
    assert!(!DatabaseUrl::new("host=h password=secret")
        .to_string()
        .contains("secret"));

    // A TOML syntax error would echo the line; the message must not.
    let e = err(&format!("[database]\nurl = {SECRET_URL}\n"));
    assert!(e.contains("line 2") && !e.contains("secret"), "{e}");
    // A bad URL is shown redacted.
    let e = err("[database]\nurl = \"mysql://u:secret@h/db\"");
    assert!(e.contains("database.url") && !e.contains("secret"), "{e}");
    let e = err("[database]\nurl = \"not a url secret\"");
    assert!(e.contains("database.url") && !e.contains("secret"), "{e}");
    // Pasted under the wrong key, still scrubbed.
    let e = err(&format!("[database]\nschema = \"{SECRET_URL}\""));
    assert!(
        e.contains("database.schema") && !e.contains("secret"),
        "{e}"
    );
    let f = file("");
    let e = Settings::load_with_env(
        &opts(&f),
        &env(&[("DATABASE_URL", "mysql://u:secret@h/db")]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("(from DATABASE_URL)") && !e.contains("secret"),
        "{e}"
    );
}

#[test]
fn scrub_secrets_handles_free_text() {
    assert_eq!(
        scrub_secrets("see postgres://a:b@c/d and x://e@f, password=hunter2&x=1"),
        "see postgres://a:***@c/d and x://e@f, password=***&x=1"
    );
}

#[test]
fn bounds_echo_the_value_as_written_and_its_layer() {
    // The value as written, not as a rewritten duration, and the real bound.
    assert_eq!(
        err("[worker]\nlease = \"100000000000s\""),
        "invalid configuration: worker.lease = \"100000000000s\": expected a duration of at most 7d"
    );
    // An integer beyond i64 is still reported at its key.
    assert_eq!(
        err("[worker]\nconsumers = 99999999999999999999"),
        "invalid configuration: worker.consumers = 99999999999999999999: expected a positive integer, at most 256 (each consumer is a claim loop with a database connection of its own)"
    );
    // A rule about a key no layer set names the defaults.
    let f = file("");
    let e = Settings::load_with_env(&opts(&f), &env(&[("VANTAGE__WORKER__CONSUMERS", "9")]))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("invalid configuration: database.max_connections = 10 (from the defaults): expected at least 11 for worker.consumers = 9"),
        "{e}"
    );
    // PG* variables are named; read only where the URL leaves them to the environment.
    let e = Settings::load_with_env(&opts(&f), &env(&[("PGPORT", "abc")]))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "invalid configuration: PGPORT = \"abc\" (from the environment): expected a port number from 1 to 65535"
    );
    let f = file("[database]\nurl = \"postgres://h:5432/db?sslmode=disable\"\n");
    assert!(Settings::load_with_env(
        &opts(&f),
        &env(&[("PGPORT", "abc"), ("PGSSLMODE", "garbage")])
    )
    .is_ok());
    for (toml, key) in [
        ("[database]\nconnect_timeout = \"0s\"", "database.connect_timeout"),
        ("[database]\nschema = \"pg_temp\"", "database.schema"),
        ("[database]\nschema = \"information_schema\"", "database.schema"),
        ("[orphans]\nheartbeat_interval = \"8d\"", "orphans.heartbeat_interval"),
        ("[log]\nlevel = \"info,[[[\"", "log.level"),
        (
            "[database]\nurl = \"postgres://u:secret@h/db?sslmode=bogus\"",
            "database.url",
        ),
        (
            "[[perspectives]]\nname = \"a\\nb\"\nevents = [\"*\"]\n[perspectives.sql]\n\"*\" = \"select 1\"",
            "perspectives[0].name",
        ),
    ] {
        let e = err(toml);
        assert!(
            e.starts_with(&format!("invalid configuration: {key} = ")) && !e.contains("secret"),
            "{toml}: {e}"
        );
    }
    // libpq's empty host: accepted, shown redacted.
    let s =
        Settings::from_toml_str("[database]\nurl = \"postgres://u:secret@/db?host=/tmp\"").unwrap();
    assert_eq!(
        s.database.url.unwrap().to_string(),
        "postgres://u:***@/db?host=/tmp"
    );
}

#[test]
fn a_versioned_perspective_needs_read_schema_tables_and_setup_and_plain_names() {
    let versioned = |extra: &str| {
        format!(
            "[[perspectives]]\nname = \"orders\"\nevents = [\"A\"]\n{extra}\n[perspectives.sql]\nA = \"select 1\"\n"
        )
    };
    let full = "version = 3\nread_schema = \"rm\"\ntables = [\"orders\"]\nsetup = \"CREATE TABLE orders (id int)\"";
    let s = Settings::from_toml_str(&versioned(full)).unwrap();
    let p = &s.perspectives[0];
    assert!(p.is_versioned());
    assert_eq!((p.version, p.read_schema.as_deref()), (3, Some("rm")));
    assert_eq!(p.tables, ["orders"]);
    // Unversioned: version 1, and none of the keys.
    let s = Settings::from_toml_str(&versioned("")).unwrap();
    assert!(!s.perspectives[0].is_versioned());
    assert_eq!(s.perspectives[0].version, 1);

    for (extra, key, says) in [
        ("version = 2", "perspectives[0].version", "no read_schema"),
        (
            "tables = [\"t\"]",
            "perspectives[0].tables",
            "no read_schema",
        ),
        ("setup = \"x\"", "perspectives[0].setup", "no read_schema"),
        (
            "version = 0\nread_schema = \"rm\"",
            "perspectives[0].version",
            "",
        ),
        (
            "read_schema = \"rm\"\nsetup = \"x\"",
            "perspectives[0].tables",
            "lists no tables",
        ),
        (
            "read_schema = \"rm\"\ntables = [\"t\"]",
            "perspectives[0].setup",
            "has no setup",
        ),
        (
            "read_schema = \"rm\"\ntables = [\"t\"]\nsetup = \" \"",
            "perspectives[0].setup",
            "has no setup",
        ),
        (
            "read_schema = \"Rm\"\ntables = [\"t\"]\nsetup = \"x\"",
            "perspectives[0].read_schema",
            "lower-case identifier",
        ),
        (
            "read_schema = \"rm\"\ntables = [\"t\", \"t\"]\nsetup = \"x\"",
            "perspectives[0].tables",
            "distinct",
        ),
        (
            "read_schema = \"rm\"\ntables = [\"a b\"]\nsetup = \"x\"",
            "perspectives[0].tables",
            "lower-case identifier",
        ),
        (
            "read_schema = \"rm\"\ntables = [\"t\"]\nsetup = \"x\"\nreset = \"TRUNCATE t\"",
            "perspectives[0].reset",
            "bumping its version",
        ),
    ] {
        let e = err(&versioned(extra));
        assert!(e.contains(key) && e.contains(says), "{extra}: {e}");
    }
    // The name becomes schema names: a plain identifier, short enough for NAME_vN.
    let long = versioned(full).replace(
        "\"orders\"\nevents",
        &format!("\"{}\"\nevents", "o".repeat(51)),
    );
    assert!(err(&long).contains("at most 50 bytes"), "{}", err(&long));
    let odd = versioned(full).replace("name = \"orders\"", "name = \"Orders\"");
    assert!(err(&odd).contains("perspectives[0].name"), "{}", err(&odd));
}

#[test]
fn slo_entries_of_both_kinds_with_their_defaults() {
    // Two lines are enough: the perspective defaults to "*", the objective to 99.9 %, the
    // window to 30 days.
    let s = Settings::from_toml_str("[[slo]]\nlag = \"30s\"").unwrap();
    assert_eq!(s.slo.len(), 1);
    let slo = &s.slo[0];
    assert_eq!(slo.perspective, "*");
    assert_eq!(
        slo.kind(),
        SloKind::Lag {
            lag: Duration::from_secs(30),
            objective: Percent::from_ppm(999_000)
        }
    );
    assert_eq!(slo.window, Duration::from_secs(30 * 86_400));
    assert_eq!(slo.name(), "lag-30s");
    assert_eq!(slo.budget().ratio(), "0.001");

    let s = Settings::from_toml_str(
        r#"
        [[slo]]
        perspective = "order_summary"
        lag = "250ms"
        objective = "99.95%"
        window = "28d"
        [[slo]]
        name = "billing-loss"
        perspective = "billing"
        dead_letter_rate = "0.01%"
        "#,
    )
    .unwrap();
    let (a, b) = (&s.slo[0], &s.slo[1]);
    assert_eq!(a.name(), "lag-250ms");
    assert_eq!(a.objective.unwrap().to_string(), "99.95%");
    assert_eq!(a.budget().ratio(), "0.0005");
    assert_eq!(a.window, Duration::from_secs(28 * 86_400));
    assert_eq!(b.kind(), SloKind::DeadLetterRate(Percent::from_ppm(100)));
    assert_eq!(b.name(), "billing-loss");
    assert_eq!(b.budget().ratio(), "0.0001");
    // `config check` shows them, and its output parses back to the same.
    let text = s.redacted_toml();
    assert!(
        text.contains("[[slo]]") && text.contains("objective = \"99.95%\""),
        "{text}"
    );
    assert_eq!(Settings::from_toml_str(&text).unwrap().slo, s.slo);
    // None configured: none shown, and the defaults are what rules are rendered from.
    assert!(!Settings::default().redacted_toml().contains("slo"));
    let defaults = SloSettings::defaults();
    assert_eq!(
        defaults.iter().map(SloSettings::name).collect::<Vec<_>>(),
        ["lag-30s", "dead-letters-0.1%"]
    );
}

#[test]
fn bad_slo_entries_name_their_key() {
    let cases = [
        // Exactly one kind.
        ("perspective = \"p\"", "slo[0]: give exactly one of lag"),
        (
            "lag = \"30s\"\ndead_letter_rate = \"1%\"",
            "slo[0]: give exactly one of lag",
        ),
        (
            "dead_letter_rate = \"1%\"\nobjective = \"99%\"",
            "slo[0].objective: a dead-letter-rate SLO has no objective",
        ),
        // The lag must be a bucket of the histogram.
        (
            "lag = \"20s\"",
            "slo[0].lag = \"20s\": expected one of 25ms, 50ms, 100ms, 250ms, 500ms, 1s, 2s 500ms, 5s, 10s, 15s, 30s, 1m, 2m, 5m, 10m, 30m, 1h",
        ),
        ("lag = \"soon\"", "slo[0].lag = \"soon\": expected a duration"),
        // Percentages.
        ("lag = \"30s\"\nobjective = \"99.9\"", "slo[0].objective = \"99.9\": expected a percentage"),
        ("lag = \"30s\"\nobjective = 0.999", "slo[0].objective = 0.999: expected a percentage"),
        ("lag = \"30s\"\nobjective = \"99.99999%\"", "slo[0].objective = \"99.99999%\": expected a percentage"),
        ("lag = \"30s\"\nobjective = \"101%\"", "slo[0].objective = \"101%\": expected a percentage"),
        ("lag = \"30s\"\nobjective = \"100%\"", "slo[0].objective = \"100%\": expected below 100% and above 93.0556%"),
        // A budget no alert could detect (14.4 × 10 % > 100 %).
        ("lag = \"30s\"\nobjective = \"90%\"", "slo[0].objective = \"90%\": expected below 100% and above 93.0556% over a window of 30d (its fastest alert fires at 14.4x"),
        ("dead_letter_rate = \"0%\"", "slo[0].dead_letter_rate = \"0%\": expected above 0% and below 6.9444%"),
        ("dead_letter_rate = \"10%\"", "slo[0].dead_letter_rate = \"10%\": expected above 0% and below 6.9444%"),
        // Windows.
        ("lag = \"30s\"\nwindow = \"1d\"", "slo[0].window = \"1d\": expected a duration of whole hours from 3d to 365d"),
        ("lag = \"30s\"\nwindow = \"400d\"", "slo[0].window = \"400d\": expected a duration of whole hours"),
        ("lag = \"30s\"\nwindow = \"30d 30m\"", "slo[0].window = \"30d 30m\": expected a duration of whole hours"),
        // Names and perspectives.
        ("lag = \"30s\"\nname = \"a b\"", "slo[0].name = \"a b\": expected 1 to 63 letters"),
        ("lag = \"30s\"\nname = \"{{ $value }}\"", "slo[0].name = \"{{ $value }}\""),
        ("lag = \"30s\"\nperspective = \"\"", "slo[0].perspective = \"\": expected a perspective's name"),
        ("lag = \"30s\"\nperspective = \"a\\nb\"", "slo[0].perspective = \"a\\nb\""),
        ("lag = \"30s\"\nlatency = \"30s\"", "unknown key slo[0].latency"),
    ];
    for (body, want) in cases {
        let e = err(&format!("[[slo]]\n{body}"));
        assert!(
            e.starts_with(&format!("invalid configuration: {want}")),
            "{body:?} gave {e}"
        );
    }
    assert!(err("slo = 3").contains("slo = 3: expected a list of tables ([[slo]])"));
    // Two SLOs covering one perspective under one name would write the same series.
    let e = err("[[slo]]\nlag = \"30s\"\n[[slo]]\nlag = \"30s\"\nobjective = \"99%\"");
    assert!(
        e.starts_with(
            "invalid configuration: slo[1].name: slo[1] and slo[0] are both named 'lag-30s'"
        ),
        "{e}"
    );
    let e = err("[[slo]]\nlag = \"30s\"\nname = \"x\"\n[[slo]]\nperspective = \"p\"\ndead_letter_rate = \"1%\"\nname = \"x\"");
    assert!(e.contains("slo[1].name"), "{e}");
    // … but a perspective's own SLO may share the wildcard's name: the wildcard leaves it out.
    assert!(Settings::from_toml_str(
        "[[slo]]\nlag = \"30s\"\n[[slo]]\nperspective = \"p\"\nlag = \"30s\"\nobjective = \"99%\""
    )
    .is_ok());
    // From the environment, as perspectives: the file only.
    let f = file("");
    let e = Settings::load_with_env(&opts(&f), &env(&[("VANTAGE__SLO__0__LAG", "30s")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("slo can only be configured in the file"), "{e}");
    // The file's entries survive other layers.
    let f = file("[[slo]]\nlag = \"1m\"\n");
    let s =
        Settings::load_with_env(&opts(&f), &env(&[("VANTAGE__WORKER__CONSUMERS", "2")])).unwrap();
    assert_eq!(
        (s.worker.consumers, s.slo[0].name()),
        (2, "lag-1m".to_owned())
    );
}
