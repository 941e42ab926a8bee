//! The replay's dry run: what a replay would write (or the error it would fail with), found in
//! a transaction that is always rolled back.

use super::replay::{envelope, PreparedReplay};
use super::DlqError;
use crate::perspective::{ApplyTx, Perspective};
use crate::store::{DeadLetter, Store, StoreError};

/// Rows of a dry run's preview at most; each value of a row (written, before, after,
/// returned) and the error are capped at [`crate::text::MAX_TEXT`] bytes, so a dry run's memory
/// is bounded whatever the read model holds.
pub const DRY_RUN_ROWS: i64 = 50;

/// One read-model row a replay would write: its table, primary key, and the row before and
/// after (`None`: absent; both `None` with no key: the table has no primary key, see `row`).
#[derive(Clone, Debug, PartialEq)]
pub struct RowChange {
    /// The table.
    pub table: String,
    /// Its primary key columns (`None`: it has none, so before and after cannot be read).
    pub key: Option<Vec<String>>,
    /// The row before the statement, as JSON text (`None`: there was none: an insert).
    pub before: Option<String>,
    /// The row after it, as JSON text (`None`: there is none any more: a delete).
    pub after: Option<String>,
    /// The row as the statement's RETURNING saw it, as JSON text.
    pub written: String,
}

/// What the statement's effect could be shown as.
#[derive(Clone, Debug, PartialEq)]
pub enum Preview {
    /// The rows it inserts, updates or deletes, before and after.
    Rows(Vec<RowChange>),
    /// It returns rows of its own (a RETURNING clause, a SELECT): those, as JSON text.
    Returned(Vec<String>),
    /// Neither could be read; the statement ran (or failed) all the same.
    Unavailable,
}

/// What a replay would come to, found by running it in a transaction that is rolled back.
#[derive(Clone, Debug, PartialEq)]
pub struct DryRun {
    /// `None`: the handler succeeds (the replay would resolve the dead letter); otherwise the
    /// error it fails with (the replay would fail again).
    pub error: Option<String>,
    /// What it writes (when it succeeds).
    pub preview: Preview,
}

/// Runs the handler on the event in a transaction that is always rolled back, and reports what
/// it would change or the error it would fail with. Nothing is committed and no history is
/// written. The statement runs twice in that transaction: once wrapped with `RETURNING` (rolled
/// back to a savepoint) to learn which rows it writes, then as the handler runs it, between
/// two reads of those rows by primary key (before and after). Sequences it advances stay
/// advanced (PostgreSQL never rolls them back).
pub async fn dry_run(
    store: &Store,
    prepared: &PreparedReplay,
    dl: &DeadLetter,
) -> Result<DryRun, DlqError> {
    use crate::store::dry_run as dr;

    let envelope = envelope(dl, prepared.event.clone());
    let params = dr::EventParams {
        data: envelope.data.clone(),
        stream_id: envelope.stream_id,
        event_id: envelope.event_id,
        event_type: envelope.event_type.clone(),
        global_position: envelope.global_position,
        stream_version: envelope.stream_version,
        metadata: envelope.metadata.clone(),
    };
    let statement = prepared
        .handler
        .statement(&envelope.event_type)
        .unwrap_or_default()
        .to_owned();

    let mut tx = store.pool().begin().await.map_err(StoreError::from)?;
    dr::savepoint_in(&mut tx).await?;
    let written = dr::written_rows_in(&mut tx, &statement, &params, DRY_RUN_ROWS)
        .await
        .ok();
    dr::rollback_to_in(&mut tx).await?;
    let returned = if written.is_none() {
        let r = dr::returned_rows_in(&mut tx, &statement, &params, DRY_RUN_ROWS)
            .await
            .ok();
        dr::rollback_to_in(&mut tx).await?;
        r
    } else {
        None
    };

    // Before: each written row's table row by primary key, as it is now.
    let mut changes = Vec::new();
    for w in written.iter().flatten() {
        let key = dr::primary_key_in(&mut tx, w.table_oid).await?;
        let before = match (&key, &w.key) {
            (Some(_), Some(k)) => dr::read_model_row_in(&mut tx, w.table_oid, k).await?,
            _ => None,
        };
        changes.push((w.clone(), key, before));
    }

    // The handler, as a replay runs it.
    let applied = prepared
        .handler
        .apply(&envelope, &mut ApplyTx::postgres(&mut tx))
        .await;
    let result = match applied {
        Err(e) => DryRun {
            error: Some(crate::text::cap(e.message()).into_owned()),
            preview: Preview::Unavailable,
        },
        Ok(()) => {
            let preview = match (written, returned) {
                (Some(_), _) => {
                    let mut rows = Vec::with_capacity(changes.len());
                    for (w, key, before) in changes {
                        let after = match (&key, &w.key) {
                            (Some(_), Some(k)) => {
                                dr::read_model_row_in(&mut tx, w.table_oid, k).await?
                            }
                            _ => None,
                        };
                        rows.push(RowChange {
                            table: w.table,
                            key,
                            before,
                            after,
                            written: w.row,
                        });
                    }
                    Preview::Rows(rows)
                }
                (None, Some(returned)) => Preview::Returned(returned),
                (None, None) => Preview::Unavailable,
            };
            DryRun {
                error: None,
                preview,
            }
        }
    };
    // Whatever happened, nothing stays.
    tx.rollback().await.map_err(StoreError::from)?;
    Ok(result)
}
