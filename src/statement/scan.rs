//! Reading statement text: just enough lexing to skip comments, string literals, quoted
//! identifiers and dollar quotes (PostgreSQL's rules, `standard_conforming_strings = on`).
//!
//! [`dollar_numbers`] is the one place that decides which `$n` a statement mentions: every
//! `$` followed by digits, each marked with whether the server reads it as a parameter. The
//! checks of a statement ([`highest_parameter`]) count only those it reads; the batch that
//! decides what to send (`store::apply`) counts every one, because sending a parameter nobody
//! reads costs bytes while not sending one that is read would be wrong.

/// One `$` followed by digits in a statement's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DollarNumber {
    /// The digits' value (`$01` is 1, as the server reads it), `u64::MAX` when it overflows.
    pub number: u64,
    /// Whether the server reads it as a positional parameter: false inside a comment, a
    /// string literal, a quoted identifier, a dollar-quoted string or an identifier (`a$1`).
    pub read: bool,
}

/// Every `$` followed by digits in `sql`, in order (see [`DollarNumber`]).
pub(crate) fn dollar_numbers(sql: &str) -> Vec<DollarNumber> {
    let s = sql.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let start = i;
        let b = s[i];
        if s[i..].starts_with(b"--") || s[i..].starts_with(b"/*") {
            i = skip_blank(s, i);
        } else if b == b'\'' {
            // E'…' allows backslash escapes; a lone e/E before the quote makes it one.
            let escapes =
                i > 0 && matches!(s[i - 1], b'e' | b'E') && (i < 2 || !is_ident(s[i - 2]));
            i = skip_quoted(s, i, b'\'', escapes);
        } else if b == b'"' {
            i = skip_quoted(s, i, b'"', false);
        } else if b == b'$' && i + 1 < s.len() && s[i + 1].is_ascii_digit() {
            let (number, end) = digits(s, i + 1);
            found.push(DollarNumber { number, read: true });
            i = end;
            continue;
        } else if b == b'$' {
            i = skip_dollar_quote(s, i);
        } else if is_ident(b) {
            // A whole identifier or number, so `a$1` stays an identifier.
            while i < s.len() && is_ident(s[i]) {
                i += 1;
            }
        } else {
            i += 1;
        }
        // What was skipped is not read by the server; its `$n` are still mentioned (the
        // digits may run past the skipped part, as after a closing `$tag$`).
        let end = i.min(s.len());
        for at in start..end {
            if s[at] == b'$' && at + 1 < s.len() && s[at + 1].is_ascii_digit() {
                let (number, _) = digits(s, at + 1);
                found.push(DollarNumber {
                    number,
                    read: false,
                });
            }
        }
    }
    found
}

/// The value of the digits starting at `i` (saturating) and the index after them.
fn digits(s: &[u8], mut i: usize) -> (u64, usize) {
    let mut value: u64 = 0;
    while i < s.len() && s[i].is_ascii_digit() {
        value = value
            .saturating_mul(10)
            .saturating_add(u64::from(s[i] - b'0'));
        i += 1;
    }
    (value, i)
}

/// The highest positional parameter (`$N`) a statement uses, outside comments, string
/// literals, quoted identifiers and dollar-quoted strings. `None` when it uses none.
pub(crate) fn highest_parameter(sql: &str) -> Option<u64> {
    dollar_numbers(sql)
        .into_iter()
        .filter(|d| d.read)
        .map(|d| d.number)
        .max()
}

/// The transaction-control command a statement starts with (`COMMIT`, `ROLLBACK PREPARED`,
/// `START TRANSACTION`, …), judged by its first keyword(s) after whitespace and comments.
pub(crate) fn transaction_control(sql: &str) -> Option<String> {
    let (first, second) = leading_keywords(sql);
    let first = first?;
    let with_second = |expected: &str| match &second {
        Some(s) if s == expected => Some(format!("{first} {s}")),
        _ => None,
    };
    match first.as_str() {
        "COMMIT" | "ROLLBACK" => with_second("PREPARED").or(Some(first)),
        "END" | "ABORT" | "BEGIN" | "SAVEPOINT" | "RELEASE" => Some(first),
        "START" => Some("START TRANSACTION".to_owned()),
        // `PREPARE name AS …` is an ordinary (if odd) statement; `PREPARE TRANSACTION` is not.
        "PREPARE" => with_second("TRANSACTION"),
        _ => None,
    }
}

/// A byte that continues an identifier (PostgreSQL: letters, digits, `_`, `$`, any non-ASCII).
fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80
}

fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b >= 0x80
}

/// Skips whitespace and comments from `i`; returns where the next token starts.
fn skip_blank(s: &[u8], mut i: usize) -> usize {
    loop {
        while i < s.len() && s[i].is_ascii_whitespace() {
            i += 1;
        }
        if s[i..].starts_with(b"--") {
            while i < s.len() && s[i] != b'\n' {
                i += 1;
            }
        } else if s[i..].starts_with(b"/*") {
            i = skip_block_comment(s, i);
        } else {
            return i;
        }
    }
}

/// `s[i..]` starts with `/*`; returns the index after the matching `*/` (comments nest).
fn skip_block_comment(s: &[u8], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < s.len() {
        if s[i..].starts_with(b"/*") {
            depth += 1;
            i += 2;
        } else if s[i..].starts_with(b"*/") {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// The first two words of a statement, upper-cased, after whitespace and comments.
fn leading_keywords(sql: &str) -> (Option<String>, Option<String>) {
    let s = sql.as_bytes();
    let word = |at: usize| -> (Option<String>, usize) {
        let start = skip_blank(s, at);
        if start >= s.len() || !is_ident_start(s[start]) {
            return (None, start);
        }
        let mut end = start;
        while end < s.len() && is_ident(s[end]) {
            end += 1;
        }
        (Some(sql[start..end].to_ascii_uppercase()), end)
    };
    let (first, end) = word(0);
    let second = first.as_ref().and_then(|_| word(end).0);
    (first, second)
}

/// `s[i]` is the opening `quote`; returns the index after the closing one (a doubled quote is
/// part of the text; so is a backslash-escaped character when `escapes`).
fn skip_quoted(s: &[u8], mut i: usize, quote: u8, escapes: bool) -> usize {
    i += 1;
    while i < s.len() {
        if escapes && s[i] == b'\\' {
            i += 2;
        } else if s[i] == quote {
            if i + 1 < s.len() && s[i + 1] == quote {
                i += 2;
            } else {
                return i + 1;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// `s[i]` is a `$` not followed by a digit: if it opens a dollar quote (`$$` or `$tag$`),
/// returns the index after its closing delimiter, else the index after the `$`.
fn skip_dollar_quote(s: &[u8], i: usize) -> usize {
    let mut end = i + 1;
    if end < s.len() && is_ident_start(s[end]) {
        while end < s.len() && is_ident(s[end]) && s[end] != b'$' {
            end += 1;
        }
    }
    if end >= s.len() || s[end] != b'$' {
        return i + 1;
    }
    let delimiter = &s[i..=end];
    let body = end + 1;
    match s[body..]
        .windows(delimiter.len())
        .position(|w| w == delimiter)
    {
        Some(at) => body + at + delimiter.len(),
        None => s.len(),
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_parameter_ignores_literals_comments_and_quotes() {
        let cases: &[(&str, Option<u64>)] = &[
            ("SELECT 1", None),
            ("INSERT INTO t VALUES ($2, $6)", Some(6)),
            ("SELECT $1->>'id', $7", Some(7)),
            ("SELECT $8", Some(8)),
            ("SELECT $10 + $2", Some(10)),
            ("SELECT $1::int+$12", Some(12)),
            ("SELECT $99999999999999999999999", Some(u64::MAX)),
            // Not parameters.
            ("SELECT '$8'", None),
            ("SELECT 'it''s $8', $1", Some(1)),
            ("SELECT E'\\'$8', $2", Some(2)),
            ("SELECT e'\\\\', $3", Some(3)),
            ("SELECT \"col$8\", $1 FROM t", Some(1)),
            ("SELECT \"a\"\"$9\" FROM t", None),
            ("SELECT 1 -- uses $8 later\n, $2", Some(2)),
            ("SELECT /* $8 /* nested $9 */ still $10 */ $3", Some(3)),
            ("SELECT $$ $8 $$, $1", Some(1)),
            ("SELECT $tag$ $8 $x$ $9 $tag$, $4", Some(4)),
            ("SELECT a$8 FROM t", None),
            // An unterminated literal hides nothing after it; prepare reports the syntax.
            ("SELECT '$8", None),
            ("SELECT $", None),
            ("SELECT x FROM t WHERE a = $8-- trailing", Some(8)),
        ];
        for (sql, want) in cases {
            assert_eq!(highest_parameter(sql), *want, "{sql:?}");
        }
    }

    #[test]
    fn transaction_control_is_judged_by_the_first_keywords() {
        let refused: &[(&str, &str)] = &[
            ("COMMIT", "COMMIT"),
            ("commit;", "COMMIT"),
            ("  \n\tCommit work", "COMMIT"),
            ("-- tidy up\nCOMMIT", "COMMIT"),
            ("/* a /* nested */ comment */ rollback", "ROLLBACK"),
            ("ROLLBACK TO SAVEPOINT s", "ROLLBACK"),
            ("END", "END"),
            ("ABORT", "ABORT"),
            ("BEGIN", "BEGIN"),
            ("begin isolation level serializable", "BEGIN"),
            ("START TRANSACTION", "START TRANSACTION"),
            ("SAVEPOINT s", "SAVEPOINT"),
            ("RELEASE SAVEPOINT s", "RELEASE"),
            ("release s", "RELEASE"),
            ("PREPARE TRANSACTION 'x'", "PREPARE TRANSACTION"),
            ("prepare /* c */ transaction 'x'", "PREPARE TRANSACTION"),
            ("COMMIT PREPARED 'x'", "COMMIT PREPARED"),
            ("rollback prepared 'x'", "ROLLBACK PREPARED"),
        ];
        for (sql, want) in refused {
            assert_eq!(transaction_control(sql).as_deref(), Some(*want), "{sql:?}");
        }
        for sql in [
            "INSERT INTO t VALUES ($1)",
            "UPDATE commits SET n = n + 1",
            "SELECT 'COMMIT'",
            "-- COMMIT\nSELECT 1",
            "/* ROLLBACK */ DELETE FROM t",
            "WITH x AS (SELECT 1) SELECT * FROM x",
            "PREPARE p AS SELECT 1",
            "TRUNCATE t",
            "\"COMMIT\"",
            "committed",
            "",
            "   ",
            "-- only a comment",
        ] {
            assert_eq!(transaction_control(sql), None, "{sql:?}");
        }
    }

    #[test]
    fn every_dollar_number_is_found_and_marked_read_or_not() {
        let found = |sql: &str| -> Vec<(u64, bool)> {
            dollar_numbers(sql)
                .into_iter()
                .map(|d| (d.number, d.read))
                .collect()
        };
        assert_eq!(found("SELECT 1"), []);
        assert_eq!(
            found("SELECT $2, '$4' -- $5"),
            [(2, true), (4, false), (5, false)]
        );
        assert_eq!(found("SELECT a$3, $01"), [(3, false), (1, true)]);
        assert_eq!(found("SELECT $$ $8 $$, $1"), [(8, false), (1, true)]);
        // The digits after a closing dollar quote are mentioned, as any `$` with digits is.
        assert_eq!(found("SELECT $a$ x $a$1"), [(1, false)]);
        assert_eq!(found("SELECT $99999999999999999999"), [(u64::MAX, true)]);
        assert_eq!(found("SELECT E'\\"), []);
    }
}
