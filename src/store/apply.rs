//! The batched apply of SQL perspectives: many events' statements in one round trip, inside the
//! batch's transaction (`apply_perspective_statements`; sent by
//! [`leases::apply_statements_and_complete`](super::leases::apply_statements_and_complete)).

use uuid::Uuid;

/// The statements of a run of events, in apply order, with their bound parameters (borrowed
/// from the events: a batch's payloads are not copied to be sent). A parameter none of the
/// batch's statements mentions is not sent at all (a NULL array: e.g. the payloads of events
/// whose statements only read `$2`, `$3`, `$5`, `$6`).
#[derive(Debug, Default)]
pub struct StatementBatch<'a> {
    statements: Vec<&'a str>,
    /// Bit `n - 1` set: some statement mentions `$n` (see [`mentioned_params`]).
    mentioned: u8,
    pub(super) statement: Vec<i32>,
    pub(super) data: Vec<&'a serde_json::Value>,
    pub(super) stream_id: Vec<Uuid>,
    pub(super) event_id: Vec<Uuid>,
    pub(super) event_type: Vec<&'a str>,
    pub(super) global_position: Vec<i64>,
    pub(super) stream_version: Vec<i32>,
    pub(super) metadata: Vec<&'a serde_json::Value>,
}

/// One event's parameters (docs/sql-contract.md, "SQL perspectives": `$1` … `$7`).
#[derive(Debug, Clone, Copy)]
pub struct StatementParams<'a> {
    /// `$1`
    pub data: &'a serde_json::Value,
    /// `$2`
    pub stream_id: Uuid,
    /// `$3`
    pub event_id: Uuid,
    /// `$4`
    pub event_type: &'a str,
    /// `$5`
    pub global_position: i64,
    /// `$6`
    pub stream_version: i32,
    /// `$7`
    pub metadata: &'a serde_json::Value,
}

impl<'a> StatementBatch<'a> {
    /// Adds one event's statement (each distinct statement is sent once).
    pub fn push(&mut self, statement: &'a str, p: StatementParams<'a>) {
        let index = match self.statements.iter().position(|s| *s == statement) {
            Some(i) => i,
            None => {
                self.statements.push(statement);
                self.mentioned |= mentioned_params(statement);
                self.statements.len() - 1
            }
        };
        self.statement.push(index as i32 + 1);
        self.data.push(p.data);
        self.stream_id.push(p.stream_id);
        self.event_id.push(p.event_id);
        self.event_type.push(p.event_type);
        self.global_position.push(p.global_position);
        self.stream_version.push(p.stream_version);
        self.metadata.push(p.metadata);
    }

    /// Events in the batch.
    pub fn len(&self) -> usize {
        self.statement.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.statement.is_empty()
    }

    /// The statement list as sent, sorted, and each event's index into it: the session's
    /// dispatcher cache (at most 16 per session, keyed by the list) is keyed by the *set* of
    /// statements, so batches that mix the same event types in another order reuse one
    /// dispatcher instead of filling the cap.
    pub(super) fn canonical(&self) -> (Vec<&'a str>, Vec<i32>) {
        let mut order: Vec<usize> = (0..self.statements.len()).collect();
        order.sort_by_key(|&i| self.statements[i]);
        let mut new_index = vec![0i32; order.len()];
        for (new, &old) in order.iter().enumerate() {
            new_index[old] = new as i32 + 1;
        }
        let statements = order.iter().map(|&i| self.statements[i]).collect();
        let statement = self
            .statement
            .iter()
            .map(|&old| new_index[(old - 1) as usize])
            .collect();
        (statements, statement)
    }

    /// `values` if some statement of the batch mentions `$n`, else nothing (sent as NULL).
    pub(super) fn sent<'v, T>(&self, n: u8, values: &'v [T]) -> Option<&'v [T]> {
        (self.mentioned & (1 << (n - 1)) != 0).then_some(values)
    }
}

/// Which of the parameters `$1` … `$7` `statement` may read: bit `n - 1` for `$n`. Any `$`
/// followed by digits counts, wherever it stands (in a string literal, a comment, after an
/// identifier's letters): a parameter is only ever read through such a token, so a false
/// "mentioned" costs the bytes of sending it and a false "not mentioned" cannot happen.
/// `$01` is `$1`, as the server reads it; numbers beyond 7 fail on the server either way.
/// The scanner is the one validation uses ([`crate::statement::scan`]); this counts every `$n`
/// it finds, read by the server or not.
pub(crate) fn mentioned_params(statement: &str) -> u8 {
    crate::statement::scan::dollar_numbers(statement)
        .into_iter()
        .filter(|d| (1..=7).contains(&d.number))
        .fold(0u8, |mask, d| mask | 1 << (d.number - 1))
}

#[cfg(test)]
mod tests {
    use super::{mentioned_params, StatementBatch, StatementParams};

    /// Issue 19, defect 19: the same statements in another order are sent as the same list
    /// (the dispatcher's key), and every event still runs its own statement.
    #[test]
    fn batches_are_sent_keyed_by_the_set_of_statements() {
        let data = serde_json::json!({});
        let p = StatementParams {
            data: &data,
            stream_id: uuid::Uuid::nil(),
            event_id: uuid::Uuid::nil(),
            event_type: "T",
            global_position: 1,
            stream_version: 1,
            metadata: &data,
        };
        let mut a = StatementBatch::default();
        for s in ["UPDATE b", "INSERT a", "UPDATE b", "DELETE c"] {
            a.push(s, p);
        }
        let mut b = StatementBatch::default();
        for s in ["DELETE c", "INSERT a", "UPDATE b"] {
            b.push(s, p);
        }
        let (sa, ia) = a.canonical();
        let (sb, ib) = b.canonical();
        assert_eq!(sa, sb);
        assert_eq!(sa, ["DELETE c", "INSERT a", "UPDATE b"]);
        let ran = |s: &[&str], i: &[i32]| -> Vec<String> {
            i.iter().map(|&n| s[(n - 1) as usize].to_owned()).collect()
        };
        assert_eq!(
            ran(&sa, &ia),
            ["UPDATE b", "INSERT a", "UPDATE b", "DELETE c"]
        );
        assert_eq!(ran(&sb, &ib), ["DELETE c", "INSERT a", "UPDATE b"]);
    }

    #[test]
    fn mentioned_params_reads_every_dollar_number() {
        assert_eq!(mentioned_params("SELECT 1"), 0);
        assert_eq!(
            mentioned_params("INSERT INTO t VALUES ($2, $6, $3, $5)"),
            0b0011_0110
        );
        assert_eq!(mentioned_params("SELECT $1->>'a', $7"), 0b0100_0001);
        // As the server reads them: $01 is $1; $10, $17 and $71 are none of the seven.
        assert_eq!(mentioned_params("SELECT $01, $10, $17, $71"), 0b0000_0001);
        // Conservative: inside literals and comments, after identifier letters.
        assert_eq!(mentioned_params("SELECT '$4' -- $5"), 0b0001_1000);
        assert_eq!(mentioned_params("SELECT a$3"), 0b0000_0100);
        assert_eq!(mentioned_params("SELECT $ 1, $$x$$, $"), 0);
        assert_eq!(mentioned_params("SELECT $99999999999999999999"), 0);
    }
}
