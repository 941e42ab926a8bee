//! Text from producers and handlers, made safe to show: human views and text logs escape
//! control and invisible characters, and every stored, logged or rendered copy of an error text
//! is capped. JSON output needs neither (serde escapes control characters; its consumers are
//! programs).

use std::borrow::Cow;
use std::fmt::Write as _;

/// Most bytes of one error text that vantage stores (`last_error`, `error_text`, history
/// `detail`), logs or renders: 64 KiB. The rest is replaced by `cap`'s
/// `… (N bytes more)`.
pub const MAX_TEXT: usize = 64 * 1024;

/// Whether `c` must not reach a terminal or a log line as it is: C0 controls (ESC, CR,
/// backspace, …) but tab and, if `newlines`, line feed; DEL; C1 controls; bidirectional
/// overrides, embeddings and isolates; zero-width characters and the byte-order mark (which
/// make one name render as another).
fn is_hazard(c: char, newlines: bool) -> bool {
    match c {
        '\t' => false,
        '\n' => !newlines,
        c if c.is_control() => true, // C0, DEL, C1
        '\u{061C}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}' => true,
        '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{2069}' | '\u{FEFF}' => true,
        _ => false,
    }
}

fn escape(text: &str, newlines: bool) -> Cow<'_, str> {
    if !text.chars().any(|c| is_hazard(c, newlines)) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            c if !is_hazard(c, newlines) => out.push(c),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
        }
    }
    Cow::Owned(out)
}

/// `text` for a terminal, one line: every hazardous character (see above), line feeds
/// included, written as an escape (`\n`, `\r`, `\u{1b}`, `\u{202e}`), so it cannot move the
/// cursor, retitle or clear the terminal, hide text or forge a line.
pub fn one_line(text: &str) -> Cow<'_, str> {
    escape(text, false)
}

/// Like [`one_line`], but line feeds stay (for a view that prints several lines).
pub fn lines(text: &str) -> Cow<'_, str> {
    escape(text, true)
}

/// How a view that keeps line feeds (and tabs) shows `c`: `None` when `c` may be shown as it
/// is, otherwise its escape as [`lines`] writes it (`\r`, `\u{202e}`). For views that mark
/// escapes up themselves (the console's HTML).
pub fn escaped_char(c: char) -> Option<String> {
    if !is_hazard(c, true) {
        return None;
    }
    let mut out = String::new();
    match c {
        '\r' => out.push_str("\\r"),
        c => {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        }
    }
    Some(out)
}

/// The first [`MAX_TEXT`] bytes of `text` (cut on a character boundary) and
/// `… (N bytes more)`; `text` itself when it is short enough.
pub fn cap(text: &str) -> Cow<'_, str> {
    cap_at(text, MAX_TEXT)
}

/// [`cap`] of a text of which only a prefix was read — at least its first [`MAX_TEXT`]
/// characters, or all of it — and whose whole length is `total` bytes: the same as [`cap`] of
/// the whole text, for a text the database cut before sending it.
pub fn cap_read(prefix: &str, total: usize) -> Cow<'_, str> {
    if total <= MAX_TEXT || prefix.len() <= MAX_TEXT {
        return Cow::Borrowed(prefix);
    }
    let mut end = MAX_TEXT;
    while !prefix.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!(
        "{}… ({} bytes more)",
        &prefix[..end],
        total.saturating_sub(end)
    ))
}

/// [`cap`] at `max` bytes.
pub fn cap_at(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!(
        "{}… ({} bytes more)",
        &text[..end],
        text.len() - end
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hazards_are_escaped_and_plain_text_is_borrowed() {
        assert!(matches!(one_line("OrderPlaced"), Cow::Borrowed(_)));
        assert_eq!(one_line("a\u{1b}]0;pwned\u{7}b"), "a\\u{1b}]0;pwned\\u{7}b");
        assert_eq!(one_line("x\u{1b}[2J"), "x\\u{1b}[2J");
        assert_eq!(one_line("ok\u{8}\u{8}no"), "ok\\u{8}\\u{8}no");
        assert_eq!(one_line("a\r\nINFO forged"), "a\\r\\nINFO forged");
        assert_eq!(lines("a\nb\rc"), "a\nb\\rc");
        assert_eq!(one_line("Order\u{202e}dekcalP"), "Order\\u{202e}dekcalP");
        assert_eq!(one_line("Order\u{200b}Placed"), "Order\\u{200b}Placed");
        assert_eq!(one_line("\u{9b}31m"), "\\u{9b}31m");
        assert_eq!(one_line("tab\there"), "tab\there");
        assert_eq!(one_line("ünïcødé ✓"), "ünïcødé ✓");
        assert_eq!(escaped_char('\u{202e}').as_deref(), Some("\\u{202e}"));
        assert_eq!(escaped_char('\r').as_deref(), Some("\\r"));
        assert_eq!(escaped_char('\n'), None);
        assert_eq!(escaped_char('é'), None);
    }

    #[test]
    fn long_texts_are_capped_on_a_character_boundary() {
        assert_eq!(cap_at("short", 10), "short");
        assert_eq!(cap_at("abcdefghij", 4), "abcd… (6 bytes more)");
        assert_eq!(cap_at("ääää", 3), "ä… (6 bytes more)");
        let big = "x".repeat(MAX_TEXT + 10);
        assert_eq!(cap(&big).len(), MAX_TEXT + "… (10 bytes more)".len());
        let wide = "é".repeat(MAX_TEXT);
        let prefix: String = wide.chars().take(MAX_TEXT).collect();
        assert_eq!(cap_read(&prefix, wide.len()), cap(&wide));
        assert_eq!(cap_read("short", 5), "short");
    }
}
