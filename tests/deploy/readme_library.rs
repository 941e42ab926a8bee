//! The README's "Build your own daemon binary" shows `examples/inventory.rs`: every piece of
//! Rust in that section is copied from the example, so the guide cannot drift from code that
//! compiles and is tested. A block may elide with a line `// …`; a block whose first line is a
//! `// src/main.rs` comment is the reader's own file (the example's, trimmed) and is not
//! compared.

use std::path::Path;

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The fenced blocks of `lang` in `text`.
fn blocks<'a>(text: &'a str, lang: &str) -> Vec<&'a str> {
    let open = format!("```{lang}\n");
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(&open) {
        let body = &rest[start + open.len()..];
        let end = body.find("```\n").expect("a closed code block");
        found.push(&body[..end]);
        rest = &body[end..];
    }
    found
}

fn section<'a>(readme: &'a str, heading: &str) -> &'a str {
    let start = readme
        .find(heading)
        .unwrap_or_else(|| panic!("README has no {heading}"));
    let body = &readme[start + heading.len()..];
    &body[..body.find("\n## ").unwrap_or(body.len())]
}

#[test]
fn the_guide_shows_the_example_verbatim() {
    let readme = read("README.md");
    let example = read("examples/inventory.rs");
    let guide = section(&readme, "## Build your own daemon binary\n");
    let rust = blocks(guide, "rust");
    assert!(
        rust.len() >= 5,
        "the guide lost its code: {} blocks",
        rust.len()
    );
    let mut compared = 0;
    for block in rust {
        if block.starts_with("// src/main.rs") {
            continue;
        }
        compared += 1;
        let mut chunk = String::new();
        for line in block.lines().chain(std::iter::once("// …")) {
            if line.trim_start().starts_with("// …") {
                assert!(
                    example.contains(&chunk),
                    "README's guide shows code that is not in examples/inventory.rs:\n{chunk}"
                );
                chunk.clear();
            } else {
                chunk.push_str(line);
                chunk.push('\n');
            }
        }
    }
    assert!(compared >= 4, "only {compared} blocks compared");
}

#[test]
fn the_guides_use_lines_are_the_examples() {
    let readme = read("README.md");
    let example = read("examples/inventory.rs");
    let guide = section(&readme, "## Build your own daemon binary\n");
    let uses = blocks(guide, "rust")
        .into_iter()
        .find(|b| b.starts_with("// src/main.rs") && b.contains("use "))
        .expect("the guide shows its use lines");
    for line in uses.lines().filter(|l| l.starts_with("use ")) {
        assert!(
            example.lines().any(|l| l == line),
            "README's `{line}` is not in examples/inventory.rs"
        );
    }
}
