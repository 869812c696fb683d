//! `docs/ops.md`, the table of every op `toma::lazy` records, is generated from the op family
//! files (`src/lazy/ops/*.rs`: each `pub fn f_op` and the first line of its documentation), so
//! it cannot drift: this test fails when the table differs from the code.
//! `TOMA_WRITE_OP_TABLE=1 cargo test --test lazy op_table` rewrites it.

use std::path::Path;

/// The rows of one family file: (op, first documentation line).
fn ops_of(source: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = source.lines().collect();
    let mut rows = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim_start().strip_prefix("pub fn f_") else { continue };
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        // The doc block right above (attributes may sit between).
        let mut j = i;
        while j > 0 && lines[j - 1].trim_start().starts_with("#[") {
            j -= 1;
        }
        while j > 0 && lines[j - 1].trim_start().starts_with("///") {
            j -= 1;
        }
        // The first paragraph, up to its first sentence.
        let mut paragraph = String::new();
        for line in &lines[j..i] {
            let text = line.trim_start().trim_start_matches("///").trim();
            if text.is_empty() || text.starts_with('#') {
                break;
            }
            if !paragraph.is_empty() {
                paragraph.push(' ');
            }
            paragraph.push_str(text);
        }
        let sentence = match paragraph.find(". ") {
            Some(end) => paragraph[..=end].to_string(),
            None => paragraph,
        };
        rows.push((name, plain(&sentence).replace('|', "\\|")));
    }
    rows
}

/// Markdown links `[text](target)` as their text.
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find("](").map(|k| open + k) else { break };
        let Some(end) = rest[close..].find(')').map(|k| close + k) else { break };
        out.push_str(&rest[..open]);
        out.push_str(&rest[open + 1..close]);
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

fn table() -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lazy/ops");
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let mut out = String::from(
        "# Ops `toma::lazy` records\n\nGenerated from `src/lazy/ops/*.rs` by `tests/lazy/op_table.rs` \
         (`TOMA_WRITE_OP_TABLE=1 cargo test --test lazy op_table`); CI fails when it differs from the code. \
         Each op also has a panicking form without `f_`, as in tch. Its file holds all its rules: how it is \
         recorded, run on a micro-batch, what its memory costs, and how a split rewrites it; its documentation \
         says when it mixes samples (and a split is refused).\n\n| op | family | what it computes |\n|---|---|---|\n",
    );
    for file in files {
        let family = file.file_stem().unwrap().to_string_lossy().into_owned();
        for (name, summary) in ops_of(&std::fs::read_to_string(&file).unwrap()) {
            out.push_str(&format!("| `{name}` | {family} | {summary} |\n"));
        }
    }
    out
}

#[test]
fn the_op_table_is_the_codes() {
    let generated = table();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ops.md");
    if std::env::var_os("TOMA_WRITE_OP_TABLE").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "docs/ops.md differs from the ops in src/lazy/ops; regenerate it: TOMA_WRITE_OP_TABLE=1 cargo test --test lazy op_table"
    );
    assert!(generated.matches("\n| `").count() >= 60, "{generated}");
}
