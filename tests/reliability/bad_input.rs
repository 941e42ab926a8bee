//! Bad input at start-up, as an operator meets it with the real `vantage run`: each case is an
//! input, the exit code it must give, what stderr must (and must not) say, and a check that
//! nothing was written (no schema created, no instance or perspective registered).
//!
//! Exit codes (docs/cli.md "Exit codes", README): 78 for what a retry will not fix (configuration,
//! credentials, a missing database, a changed migration, an address in use), 69 only for a database
//! that is not there yet.

use std::path::Path;
use std::time::Duration;

use vantage::store::{Store, StoreOptions};

use crate::support;
use crate::support::process::{self, Output};

const EXIT_CONFIG: i32 = 78;

/// Generous: only a hang should ever reach it.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// A valid SQL perspective (its table is only needed once the daemon prepares statements,
/// which none of these cases reaches).
const GOOD_PERSPECTIVE: &str = r#"
[[perspectives]]
name = "cli_model"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO public.cli_applied (stream_id, version) VALUES ($2, $6)"
"#;

/// One start-up that must be refused.
struct Case {
    name: &'static str,
    /// `database.url`.
    url: String,
    /// The configuration file after `[database]`.
    config: &'static str,
    env: Vec<(&'static str, String)>,
    code: i32,
    /// stderr must contain each of these.
    says: Vec<String>,
    /// ... and none of these (secrets, the misleading old message).
    never_says: Vec<String>,
}

async fn run_case(dir: &Path, case: &Case) -> Output {
    let config = dir.join(format!("{}.toml", case.name.replace(' ', "_")));
    std::fs::write(
        &config,
        format!("[database]\nurl = \"{}\"\n{}", case.url, case.config),
    )
    .unwrap();
    let mut env: Vec<(&str, &str)> = vec![
        ("VANTAGE__DATABASE__CONNECT_TIMEOUT", "5s"),
        ("VANTAGE__LOG__LEVEL", "info"),
    ];
    if !case.env.iter().any(|(k, _)| *k == "VANTAGE__HTTP__LISTEN") {
        env.push(("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"));
    }
    env.extend(case.env.iter().map(|(k, v)| (*k, v.as_str())));
    let out = process::run(
        process::vantage(dir, &["--config", config.to_str().unwrap(), "run"], &env),
        RUN_LIMIT,
    )
    .await;
    out.assert_no_panic();
    out
}

#[track_caller]
fn check(case: &Case, out: &Output) {
    assert_eq!(out.code, Some(case.code), "{}: {out:#?}", case.name);
    for want in &case.says {
        assert!(
            out.stderr.contains(want.as_str()),
            "{}: stderr should say {want:?}: {out:#?}",
            case.name
        );
    }
    for unwanted in &case.never_says {
        assert!(
            !out.stderr.contains(unwanted.as_str()) && !out.stdout.contains(unwanted.as_str()),
            "{}: output should not say {unwanted:?}: {out:#?}",
            case.name
        );
    }
    assert!(out.stdout.is_empty(), "{}: {out:#?}", case.name);
}

async fn connect(url: &str) -> Store {
    Store::connect(&StoreOptions::for_url(url))
        .await
        .expect("connect to the test database")
}

async fn schema_exists(store: &Store) -> bool {
    sqlx::query_scalar("SELECT to_regnamespace('vantage') IS NOT NULL")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// `url` with another user (and password) and database.
fn url_with(url: &str, user: &str, password: Option<&str>, database: Option<&str>) -> String {
    let mut u = url::Url::parse(url).unwrap();
    u.set_username(user).unwrap();
    u.set_password(password).unwrap();
    if let Some(db) = database {
        u.set_path(&format!("/{db}"));
    }
    u.to_string()
}

/// A role that must log in with a password on the throwaway server: `pg_hba.conf` gets a
/// `scram-sha-256` line for it alone (first match wins; every other role keeps `trust`).
/// `None` when the tests run against `DATABASE_URL`, whose authentication is not ours to change.
async fn password_role(admin: &Store) -> Option<(&'static str, &'static str)> {
    const ROLE: &str = "vantage_bad_input_pw";
    const PASSWORD: &str = "right-horse-battery";
    let server = tokio::task::spawn_blocking(support::throwaway_server)
        .await
        .unwrap()?;
    let hba = server.data_dir().join("pg_hba.conf");
    let current = std::fs::read_to_string(&hba).expect("read pg_hba.conf");
    let line = format!("host all {ROLE} 127.0.0.1/32 scram-sha-256\n");
    if !current.starts_with(&line) {
        std::fs::write(&hba, format!("{line}{current}")).expect("write pg_hba.conf");
    }
    process::exec(
        admin,
        &format!(
            "DO $$ BEGIN
               IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                 CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}';
               END IF;
             END $$;
             SELECT pg_reload_conf();"
        ),
    )
    .await;
    Some((ROLE, PASSWORD))
}

// ---------------------------------------------------------------------------------------------
// Before anything is written: credentials, the database, the HTTP address, the perspectives.

#[tokio::test]
async fn refused_before_anything_is_written() {
    let db = support::fresh_database().await;
    let admin = connect(&db.url).await;
    let dir = tempfile::tempdir().unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_addr = busy.local_addr().unwrap().to_string();

    let mut cases = vec![
        Case {
            name: "unknown database",
            url: url_with(
                &db.url,
                url::Url::parse(&db.url).unwrap().username(),
                None,
                Some("vantage_no_such_db"),
            ),
            config: GOOD_PERSPECTIVE,
            env: vec![],
            code: EXIT_CONFIG,
            says: vec![
                "database does not exist".into(),
                "vantage_no_such_db".into(),
            ],
            never_says: vec!["unreachable".into()],
        },
        Case {
            name: "unknown role",
            url: url_with(&db.url, "vantage_no_such_role", None, None),
            config: GOOD_PERSPECTIVE,
            env: vec![],
            code: EXIT_CONFIG,
            says: vec![
                "authentication failed".into(),
                "vantage_no_such_role".into(),
            ],
            never_says: vec!["unreachable".into()],
        },
        Case {
            name: "http.listen in use",
            url: db.url.clone(),
            config: GOOD_PERSPECTIVE,
            env: vec![("VANTAGE__HTTP__LISTEN", busy_addr.clone())],
            code: EXIT_CONFIG,
            says: vec![busy_addr.clone(), "http.listen".into()],
            never_says: vec!["applied migration".into()],
        },
        Case {
            name: "no perspectives",
            url: db.url.clone(),
            config: "",
            env: vec![],
            code: EXIT_CONFIG,
            says: vec!["no perspectives configured".into()],
            never_says: vec!["applied migration".into()],
        },
    ];
    match password_role(&admin).await {
        Some((role, password)) => cases.push(Case {
            name: "wrong password",
            url: url_with(&db.url, role, Some("wrong-guess-1234"), None),
            config: GOOD_PERSPECTIVE,
            env: vec![],
            code: EXIT_CONFIG,
            says: vec!["authentication failed".into(), role.into()],
            never_says: vec![
                "unreachable".into(),
                "wrong-guess-1234".into(),
                password.into(),
            ],
        }),
        None => {
            eprintln!("DATABASE_URL is set: the wrong-password case needs the throwaway server")
        }
    }

    for case in &cases {
        let out = run_case(dir.path(), case).await;
        check(case, &out);
        // A retry will not fix any of these: no connect_timeout spent retrying.
        assert!(
            out.elapsed < Duration::from_secs(5),
            "{}: took {:?}, as if retried: {out:#?}",
            case.name,
            out.elapsed
        );
        assert!(
            !schema_exists(&admin).await,
            "{}: the schema was created by a start that was refused",
            case.name
        );
    }
    drop(busy);
}

// ---------------------------------------------------------------------------------------------
// A migration changed after it was applied (sqlx: VersionMismatch).

#[tokio::test]
async fn a_changed_migration_checksum_exits_78_and_writes_nothing() {
    let db = support::fresh_database().await;
    let admin = connect(&db.url).await;
    admin.migrate().await.unwrap();
    process::exec(
        &admin,
        "UPDATE _sqlx_migrations SET checksum = '\\x00'::bytea \
         WHERE version = (SELECT min(version) FROM _sqlx_migrations)",
    )
    .await;
    let version = process::scalar(&admin, "SELECT min(version) FROM _sqlx_migrations").await;
    let dir = tempfile::tempdir().unwrap();
    for auto_migrate in ["true", "false"] {
        let case = Case {
            name: if auto_migrate == "true" {
                "changed checksum, auto_migrate"
            } else {
                "changed checksum, no auto_migrate"
            },
            url: db.url.clone(),
            config: GOOD_PERSPECTIVE,
            env: vec![("VANTAGE__DATABASE__AUTO_MIGRATE", auto_migrate.into())],
            code: EXIT_CONFIG,
            says: vec![format!("migration {version}"), "checksum".into()],
            never_says: vec![],
        };
        let out = run_case(dir.path(), &case).await;
        check(&case, &out);
        for table in ["wh_service_instances", "wh_perspectives"] {
            assert_eq!(
                process::scalar(&admin, &format!("SELECT count(*) FROM {table}")).await,
                0,
                "{}: a refused start wrote to {table}",
                case.name
            );
        }
    }
    // Nothing rewrote the bookkeeping either.
    assert_eq!(
        process::scalar(
            &admin,
            "SELECT count(*) FROM _sqlx_migrations WHERE checksum = '\\x00'::bytea"
        )
        .await,
        1
    );
}
