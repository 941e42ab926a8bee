//! What a replay dry run reads (`vantage dlq replay POSITION --dry-run`): which read-model rows
//! a SQL perspective's statement writes, and those rows before and after it, all inside the
//! caller's transaction (which the caller rolls back).
//!
//! The statement is the perspective's own, from the configuration; it is wrapped, never
//! edited: as `WITH __vantage_w AS (<statement> RETURNING tableoid, *) SELECT …` to learn the
//! rows an INSERT, UPDATE or DELETE touches (with their table), or, when that does not parse
//! (the statement has a RETURNING clause of its own, or is a SELECT calling a function), as
//! `WITH __vantage_w AS (<statement>) SELECT to_jsonb(…)` to show what it returns. Event
//! values are bound as parameters `$1`…`$7`, exactly as the daemon binds them.
//!
//! Memory per dry run is bounded: at most the caller's `limit` rows, and each row (written,
//! before, after, returned) leaves the database cut to [`MAX_TEXT`] characters with its length,
//! shown as [`crate::text::cap`] shows a long text.

use serde_json::Value;
use sqlx::PgConnection;

use uuid::Uuid;

use super::error::{map_db_error, StoreError};
use crate::text::MAX_TEXT;

/// The seven parameters of an event's statement, owned.
#[derive(Clone, Debug)]
pub struct EventParams {
    /// `$1`
    pub data: Value,
    /// `$2`
    pub stream_id: Uuid,
    /// `$3`
    pub event_id: Uuid,
    /// `$4`
    pub event_type: String,
    /// `$5`
    pub global_position: i64,
    /// `$6`
    pub stream_version: i32,
    /// `$7`
    pub metadata: Value,
}

/// A row a statement wrote, as RETURNING saw it: its table and the row.
#[derive(Clone, Debug, PartialEq)]
pub struct WrittenRow {
    /// The table's oid (to read the row again by its primary key).
    pub table_oid: i64,
    /// The table's name as the session sees it (`order_summary`, `public.order_summary`).
    pub table: String,
    /// The row as `to_jsonb` writes it, as text (numbers exactly as stored), capped
    /// ([`crate::text::cap`]) by the database: a dry run holds at most that much of each row.
    pub row: String,
    /// The row's primary key columns and values, as JSON text (`None`: the table has none),
    /// to read the row again by [`read_model_row_in`].
    pub key: Option<String>,
}

/// A text the database cut at [`MAX_TEXT`] characters, and its whole length in bytes, as
/// [`crate::text::cap`] would show the whole: so a huge row never reaches this process whole.
fn capped((prefix, total): (String, i64)) -> String {
    match crate::text::cap_read(&prefix, usize::try_from(total).unwrap_or(usize::MAX)) {
        std::borrow::Cow::Borrowed(_) => prefix,
        std::borrow::Cow::Owned(cut) => cut,
    }
}

fn trimmed(statement: &str) -> &str {
    statement.trim().trim_end_matches(';').trim_end()
}

macro_rules! bind_params {
    ($query:expr, $p:expr) => {
        $query
            .bind($p.data.clone())
            .bind($p.stream_id)
            .bind($p.event_id)
            .bind($p.event_type.clone())
            .bind($p.global_position)
            .bind($p.stream_version)
            .bind($p.metadata.clone())
    };
}

/// Sets the dry run's savepoint in the caller's transaction.
pub async fn savepoint_in(conn: &mut PgConnection) -> Result<(), StoreError> {
    sqlx::query("SAVEPOINT vantage_dry_run")
        .execute(conn)
        .await
        .map_err(map_db_error)?;
    Ok(())
}

/// Rolls the caller's transaction back to the dry run's savepoint.
pub async fn rollback_to_in(conn: &mut PgConnection) -> Result<(), StoreError> {
    sqlx::query("ROLLBACK TO SAVEPOINT vantage_dry_run")
        .execute(conn)
        .await
        .map_err(map_db_error)?;
    Ok(())
}

/// Runs `statement` with `RETURNING tableoid, *` added: the rows it inserted, updated or
/// deleted, with their table. An error when the wrapped statement does not run (the caller
/// rolls back to a savepoint and tries [`returned_rows_in`]).
pub async fn written_rows_in(
    conn: &mut PgConnection,
    statement: &str,
    p: &EventParams,
    limit: i64,
) -> Result<Vec<WrittenRow>, StoreError> {
    // Each row leaves the database cut to MAX_TEXT characters, with its length and its key.
    let sql = format!(
        "WITH __vantage_w AS ({} RETURNING tableoid AS __vantage_oid, *), \
              __vantage_r AS (SELECT __vantage_oid, to_jsonb(__vantage_w) - '__vantage_oid' AS r \
                              FROM __vantage_w LIMIT {limit}) \
         SELECT __vantage_oid::bigint, __vantage_oid::regclass::text, \
                left(r::text, {MAX_TEXT}), octet_length(r::text)::bigint, \
                (SELECT jsonb_object_agg(c, r -> c) \
                 FROM unnest(wh_primary_key(__vantage_oid::regclass)) AS c)::text \
         FROM __vantage_r",
        trimmed(statement)
    );
    let rows: Vec<(i64, String, String, i64, Option<String>)> =
        bind_params!(sqlx::query_as(&sql), p)
            .fetch_all(conn)
            .await
            .map_err(map_db_error)?;
    Ok(rows
        .into_iter()
        .map(|(table_oid, table, row, length, key)| WrittenRow {
            table_oid,
            table,
            row: capped((row, length)),
            key,
        })
        .collect())
}

/// Runs `statement` as it is and returns what it returns, each row as JSON (for a statement
/// with its own RETURNING clause, or a SELECT). An error when it returns nothing one can select
/// from (a plain INSERT/UPDATE/DELETE) or fails. Each row is JSON text.
pub async fn returned_rows_in(
    conn: &mut PgConnection,
    statement: &str,
    p: &EventParams,
    limit: i64,
) -> Result<Vec<String>, StoreError> {
    let sql = format!(
        "WITH __vantage_w AS ({}), \
              __vantage_r AS (SELECT to_jsonb(__vantage_w)::text AS t FROM __vantage_w LIMIT {limit}) \
         SELECT left(t, {MAX_TEXT}), octet_length(t)::bigint FROM __vantage_r",
        trimmed(statement)
    );
    let rows: Vec<(String, i64)> = bind_params!(sqlx::query_as(&sql), p)
        .fetch_all(conn)
        .await
        .map_err(map_db_error)?;
    Ok(rows.into_iter().map(capped).collect())
}

/// The primary key columns of a table (`None`: it has none).
pub async fn primary_key_in(
    conn: &mut PgConnection,
    table_oid: i64,
) -> Result<Option<Vec<String>>, StoreError> {
    sqlx::query_scalar("SELECT wh_primary_key($1::bigint::oid::regclass)")
        .bind(table_oid)
        .fetch_one(conn)
        .await
        .map_err(map_db_error)
}

/// The row of the table with primary key `key` (JSON text, [`WrittenRow::key`]), as this
/// transaction sees it now, as JSON text capped by the database as [`WrittenRow::row`] is.
pub async fn read_model_row_in(
    conn: &mut PgConnection,
    table_oid: i64,
    key: &str,
) -> Result<Option<String>, StoreError> {
    let row: (Option<String>, Option<i64>) = sqlx::query_as(&format!(
        "SELECT left(t, {MAX_TEXT}), octet_length(t)::bigint \
         FROM (SELECT wh_read_model_row($1::bigint::oid::regclass, $2::jsonb)::text AS t) AS r"
    ))
    .bind(table_oid)
    .bind(key)
    .fetch_one(conn)
    .await
    .map_err(map_db_error)?;
    Ok(match row {
        (Some(prefix), Some(length)) => Some(capped((prefix, length))),
        _ => None,
    })
}
