//! The operator console (docs/cli.md, "The console"): every route over HTTP in-process and on a
//! real socket, and what a person does with it in a real browser.
//!
//! The browser tests need Debian's `chromium` and `chromedriver`;
//! `cargo test --test console -- --ignored screenshots` rewrites the PNGs under docs/.

#[path = "../support/mod.rs"]
mod support;

mod browser;
mod http;
