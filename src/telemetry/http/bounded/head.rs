//! Where a request head ends, found in the bytes as they arrive.

/// Finds the end of a request head (an empty line, `\r\n\r\n` or `\n\n`) in the bytes read,
/// across reads. Empty lines before a request line are ignored, as HTTP/1.1 allows, so they
/// cannot end a "head" that never started.
/// Also notes whether the head announces a body (`Content-Length` other than 0, or
/// `Transfer-Encoding`), from the start of each header line.
#[derive(Default)]
pub(super) struct HeadScan {
    seen_text: bool,
    newlines: u8,
    /// The current line's first bytes, lowercased.
    line: [u8; LINE_START],
    line_len: usize,
    /// The current line is longer than `line`.
    line_cut: bool,
    body: bool,
}

/// Bytes of a header line [`HeadScan`] looks at (`content-length: ` and a number).
const LINE_START: usize = 32;

impl HeadScan {
    /// Feeds bytes; true once the head is complete.
    pub(super) fn feed(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            match b {
                b'\n' => {
                    self.end_line();
                    if self.seen_text {
                        self.newlines += 1;
                        if self.newlines == 2 {
                            return true;
                        }
                    }
                }
                b'\r' => {}
                _ => {
                    self.seen_text = true;
                    self.newlines = 0;
                    if self.line_len < LINE_START {
                        self.line[self.line_len] = b.to_ascii_lowercase();
                        self.line_len += 1;
                    } else {
                        self.line_cut = true;
                    }
                }
            }
        }
        false
    }

    fn end_line(&mut self) {
        let line = &self.line[..self.line_len];
        if let Some(value) = line.strip_prefix(b"content-length:") {
            let value = value.trim_ascii();
            self.body |= self.line_cut || value.is_empty() || value.iter().any(|&d| d != b'0');
        } else if line.starts_with(b"transfer-encoding:") {
            self.body = true;
        }
        self.line_len = 0;
        self.line_cut = false;
    }

    /// The head (complete or not) announces a body.
    pub(super) fn announces_body(&self) -> bool {
        self.body
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_says_whether_a_body_follows() {
        let scan = |head: &[u8]| {
            let mut h = HeadScan::default();
            let done = h.feed(head);
            (done, h.announces_body())
        };
        assert_eq!(
            scan(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"),
            (true, false)
        );
        assert_eq!(
            scan(b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"),
            (true, false)
        );
        assert_eq!(
            scan(b"POST / HTTP/1.1\r\ncontent-length:  12\r\n\r\n"),
            (true, true)
        );
        assert_eq!(
            scan(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            (true, true)
        );
        assert_eq!(scan(b"POST / HTTP/1.1\nContent-Length: 3\n"), (false, true));
        assert_eq!(
            scan(b"GET / HTTP/1.1\r\nX-Content-Length: 5\r\n\r\n"),
            (true, false)
        );
    }
}
