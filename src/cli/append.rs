//! `vantage append`: a producer tool for scripts and demos.
//!
//! Input: JSON lines (stdin, or `--file`), one event each:
//! `{"stream_id": uuid, "event_type": str, "data": any, "metadata"?: object,
//!   "expected_version"?: int, "event_id"?: uuid}`; blank lines are skipped.
//!
//! All or nothing: every line is parsed and checked before anything is written, and the events
//! are appended in one transaction. Consecutive lines of one stream are appended by one
//! `append_events` call, in input order; a line carrying `expected_version` starts a new call,
//! so its check sees every earlier line of the input. A malformed line or a version conflict
//! is reported as `line N: …` on stderr, exit 2, and nothing is written.
//!
//! The summary `Appended N event(s) to M stream(s).` goes to stdout (it is the command's
//! result); with `--json`, stdout carries the envelope with every event's position instead.

use std::collections::{BTreeSet, HashMap};
use std::io::{IsTerminal, Read};

use clap::Args;
use serde_json::{json, Map, Value};
use uuid::Uuid;

use super::output::{self, Failure, Ui};
use super::{exit, GlobalArgs};
use crate::store::{append_events_json_in, stored_event_ids_in, NewEvent, StoreError};

/// Options of `vantage append`.
#[derive(Debug, Clone, Args)]
pub struct AppendArgs {
    /// Read JSON lines from this file instead of stdin.
    #[arg(long)]
    pub file: Option<std::path::PathBuf>,
    /// One JSON object on stdout, with the position of every appended event.
    #[arg(long)]
    pub json: bool,
    /// A W3C traceparent (00-<trace id>-<span id>-<flags>) to put into the metadata of every
    /// event whose metadata has none: the apply of each becomes part of that trace.
    #[arg(long, value_name = "TRACEPARENT", value_parser = crate::telemetry::traces::parse_traceparent)]
    pub traceparent: Option<String>,
}

/// The keys an input line may have.
const KEYS: &[&str] = &[
    "stream_id",
    "event_type",
    "data",
    "metadata",
    "expected_version",
    "event_id",
];

/// One valid input line.
#[derive(Debug, Clone, PartialEq)]
struct Line {
    /// 1-based line number in the input.
    number: usize,
    stream_id: Uuid,
    expected_version: Option<i32>,
    event: NewEvent,
    /// `data` and `metadata` as written: what is stored (numbers exactly, never through f64).
    raw_data: String,
    raw_metadata: Option<String>,
}

/// `data` and `metadata` of a line, as written.
#[derive(serde::Deserialize)]
struct RawFields<'a> {
    #[serde(borrow, default)]
    data: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    metadata: Option<&'a serde_json::value::RawValue>,
}

/// Why a line cannot be stored at all; PostgreSQL would refuse the whole input for it.
const NUL: &str = "contains \\u0000 (NUL), which PostgreSQL's jsonb cannot store";

/// Runs `vantage append`. Exit 0; 2 for malformed input, a version conflict, or a database
/// error (nothing written); 78 for invalid configuration.
pub async fn run(global: &GlobalArgs, args: AppendArgs) -> i32 {
    let ui = Ui::new(args.json);
    let result = async {
        let settings = global
            .load_settings()
            .map_err(|e| Failure::with_code(exit::CONFIG, e.to_string()))?;
        let input = read_input(&args).await?;
        // Everything is checked before the database is even contacted.
        let mut lines = parse(&input).map_err(Failure::usage)?;
        if let Some(traceparent) = &args.traceparent {
            lines.iter_mut().for_each(|l| stamp(l, traceparent));
        }
        let store = output::connect(&settings).await?;
        let result = append(&store, &lines).await;
        store.close().await;
        let appended = result?;

        let streams: BTreeSet<Uuid> = lines.iter().map(|l| l.stream_id).collect();
        ui.say(format!(
            "Appended {} event(s) to {} stream(s).",
            lines.len(),
            streams.len()
        ));
        let events: Vec<Value> = lines
            .iter()
            .zip(&appended)
            .map(|(line, a)| {
                json!({
                    "event_id": a.event_id.to_string(),
                    "global_position": a.global_position,
                    "line": line.number,
                    "stream_id": line.stream_id.to_string(),
                    "stream_version": a.stream_version,
                })
            })
            .collect();
        Ok(json!({"appended": lines.len(), "events": events, "streams": streams.len()}))
    }
    .await;
    ui.finish(result)
}

async fn read_input(args: &AppendArgs) -> Result<Vec<u8>, Failure> {
    match &args.file {
        Some(path) => tokio::fs::read(path)
            .await
            .map_err(|e| Failure::usage(format!("cannot read {}: {e}", path.display()))),
        None => {
            if std::io::stdin().is_terminal() {
                // Otherwise a person would face a silent wait for end of input.
                eprintln!("Reading JSON lines from stdin; end with Ctrl-D.");
            }
            read_stdin().await
        }
    }
}

async fn read_stdin() -> Result<Vec<u8>, Failure> {
    tokio::task::spawn_blocking(|| {
        let mut s = Vec::new();
        std::io::stdin().read_to_end(&mut s).map(|_| s)
    })
    .await
    .map_err(|e| Failure::usage(format!("cannot read stdin: {e}")))?
    .map_err(|e| Failure::usage(format!("cannot read stdin: {e}")))
}

/// Parses and checks every line; the first problem is `line N: …`. A UTF-8 byte order mark at
/// the start of the input is skipped (editors on some systems write one).
fn parse(input: &[u8]) -> Result<Vec<Line>, String> {
    let input = input.strip_prefix(b"\xef\xbb\xbf").unwrap_or(input);
    let mut lines = Vec::new();
    let mut event_ids: HashMap<Uuid, usize> = HashMap::new();
    for (i, bytes) in input.split(|b| *b == b'\n').enumerate() {
        let number = i + 1;
        let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
        let text = std::str::from_utf8(bytes).map_err(|e| {
            format!(
                "line {number}: not valid UTF-8 (at byte {})",
                e.valid_up_to()
            )
        })?;
        if text.trim().is_empty() {
            continue;
        }
        let line = parse_line(number, text).map_err(|e| format!("line {number}: {e}"))?;
        if let Some(id) = line.event.event_id {
            if let Some(first) = event_ids.insert(id, number) {
                return Err(format!(
                    "line {number}: event_id {id} is already used on line {first}"
                ));
            }
        }
        lines.push(line);
    }
    Ok(lines)
}

fn parse_line(number: usize, text: &str) -> Result<Line, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(mut obj) = value else {
        return Err("expected a JSON object".to_owned());
    };
    if let Some(unknown) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(format!(
            "unknown key \"{unknown}\" (expected {})",
            KEYS.join(", ")
        ));
    }
    let stream_id =
        uuid_field(&obj, "stream_id")?.ok_or_else(|| "missing \"stream_id\"".to_owned())?;
    let event_type = match obj.get("event_type") {
        Some(Value::String(s)) if s.trim().is_empty() => {
            return Err("\"event_type\" is empty".to_owned())
        }
        // Types are matched exactly: " A " would be stored and then match nothing.
        Some(Value::String(s)) if s.trim() != s => {
            return Err(format!(
                "\"event_type\" {s:?} has leading or trailing white space; event types are matched exactly"
            ))
        }
        Some(Value::String(s)) if s.contains('\0') => {
            return Err(format!("\"event_type\" {NUL}"))
        }
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(format!(
                "\"event_type\" must be a string, not {}",
                kind(other)
            ))
        }
        None => return Err("missing \"event_type\"".to_owned()),
    };
    let data = obj
        .remove("data")
        .ok_or_else(|| "missing \"data\"".to_owned())?;
    let metadata = match obj.remove("metadata") {
        None | Some(Value::Null) => None,
        Some(m @ Value::Object(_)) => Some(m),
        Some(other) => {
            return Err(format!(
                "\"metadata\" must be an object, not {}",
                kind(&other)
            ))
        }
    };
    let expected_version = match obj.get("expected_version") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .filter(|n| (0..=i64::from(i32::MAX)).contains(n))
                .map(|n| n as i32)
                .ok_or_else(|| {
                    format!("\"expected_version\" must be a non-negative integer, not {v}")
                })?,
        ),
    };
    let event_id = uuid_field(&obj, "event_id")?;
    if has_nul(&data) {
        return Err(format!("\"data\" {NUL}"));
    }
    if metadata.as_ref().is_some_and(has_nul) {
        return Err(format!("\"metadata\" {NUL}"));
    }
    // The same line again, keeping data and metadata as written (the parse above checked it).
    let raw: RawFields<'_> =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let raw_data = raw.data.map_or("null", |r| r.get()).to_owned();
    let raw_metadata = metadata
        .as_ref()
        .and(raw.metadata)
        .map(|r| r.get().to_owned());
    Ok(Line {
        number,
        stream_id,
        expected_version,
        event: NewEvent {
            event_type,
            data,
            metadata,
            event_id,
        },
        raw_data,
        raw_metadata,
    })
}

/// Puts `traceparent` into the line's metadata unless it has one; the metadata as written is
/// kept byte for byte, the key inserted first.
fn stamp(line: &mut Line, traceparent: &str) {
    let metadata = line
        .event
        .metadata
        .get_or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(map) = metadata else {
        return;
    };
    if map.contains_key("traceparent") {
        return;
    }
    let was_empty = map.is_empty();
    map.insert(
        "traceparent".to_owned(),
        Value::String(traceparent.to_owned()),
    );
    let key = format!("\"traceparent\":{}", Value::String(traceparent.to_owned()));
    line.raw_metadata = Some(match line.raw_metadata.take() {
        // An object's raw text starts with `{` (serde_json keeps the exact slice).
        Some(raw) if !was_empty && raw.starts_with('{') => format!("{{{key},{}", &raw[1..]),
        _ => format!("{{{key}}}"),
    });
}

/// Whether a NUL character is anywhere in `v` (strings or keys).
fn has_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(has_nul),
        Value::Object(o) => o.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

/// The `p_events` array of `append_events` for a run of lines, as JSON text with data and
/// metadata exactly as written.
fn events_json(group: &[Line]) -> String {
    let mut out = String::from("[");
    for (i, line) in group.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let event_type = Value::String(line.event.event_type.clone()).to_string();
        out.push_str(&format!(
            "{{\"event_type\":{event_type},\"data\":{}",
            line.raw_data
        ));
        if let Some(metadata) = &line.raw_metadata {
            out.push_str(&format!(",\"metadata\":{metadata}"));
        }
        if let Some(id) = line.event.event_id {
            out.push_str(&format!(",\"event_id\":\"{id}\""));
        }
        out.push('}');
    }
    out.push(']');
    out
}

fn uuid_field(obj: &Map<String, Value>, key: &str) -> Result<Option<Uuid>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Uuid::parse_str(s)
            .map(Some)
            .map_err(|e| format!("\"{key}\" is not a UUID ({s:?}: {e})")),
        Some(other) => Err(format!(
            "\"{key}\" must be a UUID string, not {}",
            kind(other)
        )),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Runs of lines appended by one call: consecutive lines of one stream, a new run starting at
/// every line that carries `expected_version`.
fn groups(lines: &[Line]) -> Vec<&[Line]> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=lines.len() {
        let boundary = i == lines.len()
            || lines[i].stream_id != lines[start].stream_id
            || lines[i].expected_version.is_some();
        if boundary {
            out.push(&lines[start..i]);
            start = i;
        }
    }
    out
}

/// Appends everything in one transaction; returns what each line became, in input order.
async fn append(
    store: &crate::store::Store,
    lines: &[Line],
) -> Result<Vec<crate::store::AppendedEvent>, Failure> {
    let db = |e: StoreError| output::store_failure(&e);
    let mut tx = store.pool().begin().await.map_err(|e| db(e.into()))?;
    // An event id already stored would fail the insert with the constraint's raw text.
    let ids: Vec<Uuid> = lines.iter().filter_map(|l| l.event.event_id).collect();
    let stored = stored_event_ids_in(&mut tx, &ids).await.map_err(db)?;
    if let Some(line) = lines.iter().find_map(|l| {
        let id = l.event.event_id?;
        stored
            .iter()
            .find(|(s, _)| *s == id)
            .map(|(_, p)| (l, id, *p))
    }) {
        let (line, id, position) = line;
        return Err(Failure::usage(format!(
            "line {}: event_id {id} is already in the event store (global position {position}). Nothing was written.",
            line.number
        )));
    }
    let mut appended = Vec::with_capacity(lines.len());
    for group in groups(lines) {
        let first = &group[0];
        match append_events_json_in(
            &mut tx,
            first.stream_id,
            first.expected_version,
            &events_json(group),
        )
        .await
        {
            Ok(rows) => appended.extend(rows),
            Err(e) => {
                // Dropping the transaction rolls it back; say so only once it has.
                let _ = tx.rollback().await;
                let last = group[group.len() - 1].number;
                let lines = if last == first.number {
                    format!("line {}", first.number)
                } else {
                    format!("lines {}-{last}", first.number)
                };
                return Err(match e {
                    StoreError::Conflict(message) => Failure::usage(format!(
                        "line {}: version conflict: {message}. Nothing was written.",
                        first.number
                    )),
                    e if e.is_connection_error() => db(e),
                    e => Failure::usage(format!(
                        "{lines}: the database refused the events: {e}. Nothing was written."
                    )),
                });
            }
        }
    }
    tx.commit().await.map_err(|e| db(e.into()))?;
    Ok(appended)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S1: &str = "6f1c1a8e-5f4e-4c59-9d59-0d3b8f1c2a01";
    const S2: &str = "6f1c1a8e-5f4e-4c59-9d59-0d3b8f1c2a02";

    fn err(input: &str) -> String {
        parse(input.as_bytes()).unwrap_err()
    }

    #[test]
    fn valid_lines_and_blank_lines() {
        let input = format!(
            "{{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":{{\"x\":1}}}}\n\n  \n\
             {{\"stream_id\":\"{S1}\",\"event_type\":\"B\",\"data\":null,\"metadata\":{{\"m\":1}},\"expected_version\":1}}\n"
        );
        let lines = parse(input.as_bytes()).unwrap();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].number, 1);
        assert_eq!(lines[1].number, 4);
        assert_eq!(lines[1].expected_version, Some(1));
        assert_eq!(lines[1].event.metadata, Some(json!({"m": 1})));
    }

    #[test]
    fn malformed_lines_name_their_number_and_problem() {
        let ok = format!("{{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":1}}");
        assert_eq!(
            err(&format!("{ok}\n{{nope")),
            "line 2: not valid JSON: key must be a string at line 1 column 2"
        );
        assert_eq!(err("[1]"), "line 1: expected a JSON object");
        assert!(
            err("{\"event_type\":\"A\",\"data\":1}").starts_with("line 1: missing \"stream_id\"")
        );
        assert!(err("{\"stream_id\":\"x\",\"event_type\":\"A\",\"data\":1}")
            .starts_with("line 1: \"stream_id\" is not a UUID"));
        assert!(err(&format!("{{\"stream_id\":\"{S1}\",\"data\":1}}"))
            .starts_with("line 1: missing \"event_type\""));
        assert!(err(&format!(
            "{{\"stream_id\":\"{S1}\",\"event_type\":\"\",\"data\":1}}"
        ))
        .starts_with("line 1: \"event_type\" is empty"));
        assert!(
            err(&format!("{{\"stream_id\":\"{S1}\",\"event_type\":\"A\"}}"))
                .starts_with("line 1: missing \"data\"")
        );
        assert!(err(&format!(
            "{{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":1,\"metadata\":[]}}"
        ))
        .starts_with("line 1: \"metadata\" must be an object"));
        assert!(err(&format!(
            "{{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":1,\"expected_version\":-1}}"
        ))
        .starts_with("line 1: \"expected_version\" must be a non-negative integer"));
        assert!(err(&format!(
            "{{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":1,\"evnt_id\":1}}"
        ))
        .starts_with("line 1: unknown key \"evnt_id\""));
        let id = "1f1c1a8e-5f4e-4c59-9d59-0d3b8f1c2a01";
        let with_id = format!(
            "{{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":1,\"event_id\":\"{id}\"}}"
        );
        assert_eq!(
            err(&format!("{with_id}\n{with_id}")),
            format!("line 2: event_id {id} is already used on line 1")
        );
    }

    #[test]
    fn groups_follow_streams_and_expected_versions() {
        let line = |n: usize, s: &str, ev: Option<i32>| Line {
            number: n,
            stream_id: Uuid::parse_str(s).unwrap(),
            expected_version: ev,
            event: NewEvent::new("A", json!(1)),
            raw_data: "1".into(),
            raw_metadata: None,
        };
        let lines = vec![
            line(1, S1, Some(0)),
            line(2, S1, None),
            line(3, S2, None),
            line(4, S1, None),
            line(5, S1, Some(3)),
            line(6, S1, None),
        ];
        let g: Vec<Vec<usize>> = groups(&lines)
            .iter()
            .map(|g| g.iter().map(|l| l.number).collect())
            .collect();
        assert_eq!(g, vec![vec![1, 2], vec![3], vec![4], vec![5, 6]]);
        assert!(groups(&[]).is_empty());
    }

    #[test]
    fn a_traceparent_is_stamped_into_metadata_that_has_none_keeping_the_rest_as_written() {
        const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        const OWN: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let input = format!(
            "{{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":1}}\n\
             {{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":1,\"metadata\":{{}}}}\n\
             {{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":1,\"metadata\":{{\"n\": 1.50}}}}\n\
             {{\"stream_id\":\"{S1}\",\"event_type\":\"A\",\"data\":1,\"metadata\":{{\"traceparent\":\"{OWN}\"}}}}\n"
        );
        let mut lines = parse(input.as_bytes()).unwrap();
        lines.iter_mut().for_each(|l| stamp(l, TP));
        let raw: Vec<&str> = lines
            .iter()
            .map(|l| l.raw_metadata.as_deref().unwrap())
            .collect();
        assert_eq!(raw[0], format!("{{\"traceparent\":\"{TP}\"}}"));
        assert_eq!(raw[1], format!("{{\"traceparent\":\"{TP}\"}}"));
        // The number stays as written (1.50, not 1.5).
        assert_eq!(raw[2], format!("{{\"traceparent\":\"{TP}\",\"n\": 1.50}}"));
        assert_eq!(raw[3], format!("{{\"traceparent\":\"{OWN}\"}}"));
        for (l, r) in lines.iter().zip(&raw) {
            let parsed: Value = serde_json::from_str(r).unwrap();
            assert_eq!(Some(&parsed), l.event.metadata.as_ref());
        }
    }
}
