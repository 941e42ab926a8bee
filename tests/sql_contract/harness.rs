//! The test harness itself: fresh databases are isolated, usable, and cleaned up.

use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

use crate::support;

async fn pool(db: &support::TestDatabase) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(std::time::Duration::from_secs(10))
        .connect(&db.url)
        .await
        .expect("connect to the test database")
}

/// Both isolation tests create the same table without IF NOT EXISTS: if they shared a
/// database, one of them would fail.
async fn create_table_in_fresh_database() {
    let db = support::fresh_database().await;
    let pool = pool(&db).await;

    let current: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(current, db.name);

    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(tables, 0, "a fresh database has no tables");

    sqlx::query("CREATE TABLE harness_probe (id int PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO harness_probe VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM harness_probe")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
    // The pool is deliberately left open: dropping the database must force it out.
}

#[tokio::test]
async fn fresh_database_is_isolated_a() {
    create_table_in_fresh_database().await;
}

#[tokio::test]
async fn fresh_database_is_isolated_b() {
    create_table_in_fresh_database().await;
}

#[tokio::test]
async fn select_version() {
    let db = support::fresh_database().await;
    let pool = pool(&db).await;
    let version: String = sqlx::query_scalar("SELECT version()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(version.starts_with("PostgreSQL "), "{version}");
}

#[tokio::test]
async fn dropping_the_handle_drops_the_database() {
    let db = support::fresh_database().await;
    let name = db.name.clone();
    let orphan = pool(&db).await;
    drop(db);

    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&pool(&support::fresh_database().await).await)
            .await
            .unwrap();
    assert!(!exists, "database {name} should be gone");
    // The connection into the dropped database was terminated by WITH (FORCE).
    assert!(sqlx::query("SELECT 1").execute(&orphan).await.is_err());
}
