//! The queries of the operator console (docs/cli.md, "The console") beyond those it shares with the CLI
//! (`perspective_status`, `live_instances`, `event_at`, `dead_letter_history`).
//!
//! - Every statement of the console runs with a `statement_timeout`: the console's [`Store`]
//!   comes from [`Store::with_statement_timeout`], whose sessions carry it as a startup option,
//!   so the shared calls are bounded too and a slow page can never hold a connection for long.
//! - List pages never load payloads: no event data, and only the first
//!   [`ERROR_PREVIEW_CHARS`] characters of an error text.
//! - Pages are walked by keyset on (`global_position`, `dead_letter_id`), newest position
//!   first, which the existing index on `global_position` serves; never by `OFFSET`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

use super::dead_letters::DeadLetter;
use super::error::{map_db_error, StoreError};
use super::handle::Store;

/// Characters of the error text a list row carries.
pub const ERROR_PREVIEW_CHARS: i32 = 200;

/// Which dead letters a list shows. Every field is optional; `None` matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Exactly this perspective.
    pub perspective: Option<String>,
    /// Exactly this failure reason (`MaxAttemptsExceeded`, `PermanentFailure`).
    pub reason: Option<String>,
    /// Exactly this event type.
    pub event_type: Option<String>,
    /// The error text contains this, ignoring case (a plain substring, not a pattern).
    pub error_contains: Option<String>,
    /// Dead-lettered at or after.
    pub since: Option<DateTime<Utc>>,
    /// Dead-lettered before.
    pub until: Option<DateTime<Utc>>,
    /// This status (`exhausted` = open); `None` = any status.
    pub status: Option<String>,
    /// Exactly this error fingerprint (`vantage dlq groups`).
    pub group: Option<String>,
}

/// Where a page starts: strictly after this (position, id) in the list's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadLetterCursor {
    /// The global position of the last row of the previous page.
    pub global_position: i64,
    /// Its dead letter id (breaks ties between perspectives at one position).
    pub dead_letter_id: Uuid,
}

/// One row of the dead-letter list: what the list shows, no payload.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct DeadLetterSummary {
    /// Its id.
    pub dead_letter_id: Uuid,
    /// The perspective.
    pub perspective_name: String,
    /// The event's global position.
    pub global_position: i64,
    /// The event's type.
    pub event_type: Option<String>,
    /// Why.
    pub failure_reason: String,
    /// The first [`ERROR_PREVIEW_CHARS`] characters of the error text.
    pub error_preview: Option<String>,
    /// Whether the error text is longer than the preview.
    pub error_truncated: bool,
    /// Claims when dead-lettered.
    pub attempts_when_dlq: i32,
    /// When.
    pub dead_lettered_at: DateTime<Utc>,
    /// `exhausted`, `resolved`, `purged` or `requeued`.
    pub status: String,
}

impl DeadLetterSummary {
    /// The cursor of the page that follows this row.
    pub fn cursor(&self) -> DeadLetterCursor {
        DeadLetterCursor {
            global_position: self.global_position,
            dead_letter_id: self.dead_letter_id,
        }
    }
}

/// One page of the list.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetterPage {
    /// At most the requested number of rows.
    pub rows: Vec<DeadLetterSummary>,
    /// Where the next page starts, when there is one.
    pub next: Option<DeadLetterCursor>,
}

/// The filter's predicate over `wh_dead_letters`, parameters `$1`…`$8` in
/// [`DeadLetterFilter`]'s field order (see [`bind_filter`]).
const FILTER_WHERE: &str = "($1::text IS NULL OR perspective_name = $1) \
    AND ($2::text IS NULL OR failure_reason = $2) \
    AND ($3::text IS NULL OR event_type = $3) \
    AND ($4::text IS NULL OR strpos(lower(coalesce(error_text, '')), lower($4)) > 0) \
    AND ($5::timestamptz IS NULL OR dead_lettered_at >= $5) \
    AND ($6::timestamptz IS NULL OR dead_lettered_at < $6) \
    AND ($7::text IS NULL OR status = $7) \
    AND ($8::text IS NULL OR error_fingerprint = $8)";

macro_rules! bind_filter {
    ($query:expr, $f:expr) => {
        $query
            .bind($f.perspective.as_deref())
            .bind($f.reason.as_deref())
            .bind($f.event_type.as_deref())
            .bind($f.error_contains.as_deref())
            .bind($f.since)
            .bind($f.until)
            .bind($f.status.as_deref())
            .bind($f.group.as_deref())
    };
}

impl Store {
    /// A store on the same database whose every session runs with `statement_timeout` set to
    /// `timeout` (a startup option, so it holds for every statement, shared calls included).
    /// Its pool is new and lazy, as large as this one's.
    pub(crate) fn with_statement_timeout(&self, timeout: Duration) -> Store {
        let millis = timeout.as_millis().clamp(1, i32::MAX as u128).to_string();
        let connect = (*self.pool.connect_options())
            .clone()
            .options([("statement_timeout", millis)]);
        let pool = PgPoolOptions::new()
            .max_connections(self.pool.options().get_max_connections())
            .min_connections(0)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(connect);
        Store {
            pool,
            schema: self.schema.clone(),
            target: self.target.clone(),
            batch_sessions: Default::default(),
        }
    }

    /// One page of dead letters matching `filter`, newest position first, starting after
    /// `after`; `limit` rows at most (one more is read to know whether a next page exists).
    pub(crate) async fn dead_letter_page(
        &self,
        filter: &DeadLetterFilter,
        after: Option<DeadLetterCursor>,
        limit: u32,
    ) -> Result<DeadLetterPage, StoreError> {
        let limit = limit.max(1);
        let sql = format!(
            "SELECT dead_letter_id, perspective_name, global_position, event_type, \
                    failure_reason, left(error_text, {ERROR_PREVIEW_CHARS}) AS error_preview, \
                    coalesce(length(error_text) > {ERROR_PREVIEW_CHARS}, false) AS error_truncated, \
                    attempts_when_dlq, dead_lettered_at, status \
             FROM wh_dead_letters \
             WHERE {FILTER_WHERE} \
               AND ($9::bigint IS NULL OR (global_position, dead_letter_id) < ($9, $10::uuid)) \
             ORDER BY global_position DESC, dead_letter_id DESC \
             LIMIT $11"
        );
        let query = bind_filter!(sqlx::query_as::<_, DeadLetterSummary>(&sql), filter)
            .bind(after.map(|c| c.global_position))
            .bind(after.map(|c| c.dead_letter_id))
            .bind(i64::from(limit) + 1);
        let mut rows = query.fetch_all(&self.pool).await.map_err(map_db_error)?;
        let next = if rows.len() > limit as usize {
            rows.truncate(limit as usize);
            rows.last().map(DeadLetterSummary::cursor)
        } else {
            None
        };
        Ok(DeadLetterPage { rows, next })
    }

    /// How many dead letters match `filter`. `None` when counting took longer than the
    /// session's `statement_timeout` (SQLSTATE 57014): a page can say so instead of failing.
    pub(crate) async fn dead_letter_count(
        &self,
        filter: &DeadLetterFilter,
    ) -> Result<Option<i64>, StoreError> {
        let sql = format!("SELECT count(*) FROM wh_dead_letters WHERE {FILTER_WHERE}");
        let counted = bind_filter!(sqlx::query_scalar::<_, i64>(&sql), filter)
            .fetch_one(&self.pool)
            .await;
        match counted {
            Ok(n) => Ok(Some(n)),
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("57014") => Ok(None),
            Err(e) => Err(map_db_error(e)),
        }
    }

    /// The dead letters of (`global_position`, `perspective`), whatever their status, newest
    /// first: an event requeued and dead-lettered again has several. The permalink of the
    /// console's detail page.
    pub(crate) async fn dead_letters_of(
        &self,
        global_position: i64,
        perspective: &str,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        // `DeadLetter` reads its columns by name; the table holds no payload.
        sqlx::query_as(
            "SELECT * FROM wh_dead_letters \
             WHERE global_position = $1 AND perspective_name = $2 \
             ORDER BY dead_lettered_at DESC, dead_letter_id DESC",
        )
        .bind(global_position)
        .bind(perspective)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }
}

/// The order of [`Store::open_dead_letters_counted`]'s rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BulkOrder {
    /// Lowest position first (the console's bulk actions).
    Position,
    /// By perspective, then position (the CLI's bulk walk, continued by
    /// [`Store::open_dead_letters_after`]).
    PerspectivePosition,
}

/// How many open dead letters match a filter and the first of them, read in one statement, so
/// both describe the same moment.
#[derive(Clone, Debug, PartialEq)]
pub struct CountedDeadLetters {
    /// How many match.
    pub matching: i64,
    /// The first of them in the requested order, at most the requested number.
    pub first: Vec<DeadLetter>,
    /// The database's clock during the count: every dead letter counted was dead-lettered
    /// before it, so a walk that continues past the first page with `until` at most this acts
    /// on what was counted, not on what was dead-lettered since.
    pub as_of: DateTime<Utc>,
}

impl Store {
    /// How many open dead letters match `filter` (whatever `filter.status` says) and the first
    /// `limit` of them in `order`, in **one statement** (one snapshot): a bulk action compares
    /// the count and the set with what its preview showed, and two statements could see two
    /// different moments (a count from before another operator's change and a set from after
    /// it), so a refusal would give a reason true of neither. `None` when it took longer than
    /// the session's `statement_timeout` (SQLSTATE 57014).
    pub(crate) async fn open_dead_letters_counted(
        &self,
        filter: &DeadLetterFilter,
        order: BulkOrder,
        limit: u32,
    ) -> Result<Option<CountedDeadLetters>, StoreError> {
        use sqlx::{FromRow as _, Row as _};
        let open = DeadLetterFilter {
            status: Some("exhausted".to_owned()),
            ..filter.clone()
        };
        let order_by = match order {
            BulkOrder::Position => "global_position, dead_letter_id",
            BulkOrder::PerspectivePosition => "perspective_name, global_position",
        };
        // The count is an uncorrelated subquery: evaluated once, in the statement's snapshot.
        // So is the clock, read while the statement runs, after its snapshot was taken: every
        // dead letter counted began (and took its `dead_lettered_at`) before that reading.
        // With no row returned nothing matched (`limit` is at least 1), so the count is 0.
        let sql = format!(
            "SELECT (SELECT count(*) FROM wh_dead_letters WHERE {FILTER_WHERE}) AS vantage_matching, \
                    (SELECT clock_timestamp()) AS vantage_as_of, * \
             FROM wh_dead_letters WHERE {FILTER_WHERE} ORDER BY {order_by} LIMIT $9"
        );

        // In a transaction of its own: sqlx prepares a statement new to the connection in an
        // exchange of its own, and the table lock taken to plan it would otherwise be let go
        // before the read, so a writer queued behind it (a purge) could slip in between: the
        // count and the set would still agree, but describe a later moment than the one the
        // read waited for.
        let mut tx = self.pool.begin().await.map_err(map_db_error)?;
        let fetched = bind_filter!(sqlx::query(&sql), open)
            .bind(i64::from(limit.max(1)))
            .fetch_all(&mut *tx)
            .await;
        if fetched.is_ok() {
            tx.commit().await.map_err(map_db_error)?;
        }
        let rows = match fetched {
            Ok(rows) => rows,
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("57014") => {
                return Ok(None)
            }
            Err(e) => return Err(map_db_error(e)),
        };
        let (matching, as_of) = match rows.first() {
            Some(row) => (
                row.try_get("vantage_matching").map_err(map_db_error)?,
                row.try_get("vantage_as_of").map_err(map_db_error)?,
            ),
            None => (0, Utc::now()),
        };
        let first = rows
            .iter()
            .map(DeadLetter::from_row)
            .collect::<Result<Vec<_>, _>>()
            .map_err(map_db_error)?;
        Ok(Some(CountedDeadLetters {
            matching,
            first,
            as_of,
        }))
    }

    /// The open dead letters matching `filter` (whatever `filter.status` says) by perspective,
    /// then position, strictly after `after` (perspective, position: a keyset cursor, unique among
    /// open dead letters), at most `limit`: what the CLI's bulk actions walk, a page at a time,
    /// so a large set is never loaded at once.
    pub(crate) async fn open_dead_letters_after(
        &self,
        filter: &DeadLetterFilter,
        after: Option<(&str, i64)>,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let open = DeadLetterFilter {
            status: Some("exhausted".to_owned()),
            ..filter.clone()
        };
        let sql = format!(
            "SELECT * FROM wh_dead_letters WHERE {FILTER_WHERE} \
               AND ($9::text IS NULL OR (perspective_name, global_position) > ($9, $10::bigint)) \
             ORDER BY perspective_name, global_position LIMIT $11"
        );
        bind_filter!(sqlx::query_as::<_, DeadLetter>(&sql), open)
            .bind(after.map(|c| c.0))
            .bind(after.map(|c| c.1))
            .bind(limit.max(0))
            .fetch_all(&self.pool)
            .await
            .map_err(map_db_error)
    }
}
