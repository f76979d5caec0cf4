//! The documented configuration and the parsed one agree: every key in `config/README.md` and
//! `config/transfer-engine.json` is a key the typed settings read (with the same default), or one
//! listed as having no effect, and the other way round; and no code outside the config module
//! reads the config tree by path.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use tent::config::{Effect, KeySpec, Settings};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The rows `| `key` | default | ... |` of the table under each `## ` heading of the README.
fn readme_tables() -> BTreeMap<String, BTreeMap<String, String>> {
    let text = std::fs::read_to_string(root().join("config/README.md")).expect("config/README.md");
    let mut tables: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut heading = String::new();
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            heading = h.trim().to_string();
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // "", key, default, meaning..., "": only rows whose first cell is one backticked key.
        if cells.len() < 4 || !cells[1].starts_with('`') || cells[1].matches('`').count() != 2 {
            continue;
        }
        let key = cells[1].trim_matches('`').to_string();
        let previous = tables.entry(heading.clone()).or_default().insert(key.clone(), cells[2].to_string());
        assert!(previous.is_none(), "config/README.md lists {key} twice under {heading}");
    }
    tables
}

/// Reads a documented default: backticked JSON, or words for a machine-dependent default.
fn documented_default(cell: &str) -> Result<Value, String> {
    let inner = cell.trim();
    if inner.starts_with('`') && inner.ends_with('`') && inner.matches('`').count() == 2 {
        let json = inner.trim_matches('`');
        return serde_json::from_str(json).map_err(|e| format!("{json}: {e}"));
    }
    Err(inner.to_string())
}

/// Two defaults are equal when their JSON is, comparing numbers by value (`1e-09` is `1e-9`).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

fn check_default(spec: &KeySpec, cell: &str, problems: &mut Vec<String>) {
    match (documented_default(cell), spec.default_text) {
        (Ok(doc), None) if same(&doc, &spec.default) => {}
        (Err(words), Some(text)) if words == text => {}
        (doc, _) => problems.push(format!(
            "{}: config/README.md says the default is {cell} ({doc:?}), the code {} {:?}",
            spec.path, spec.default, spec.default_text
        )),
    }
}

const USED: &str = "Keys";
const NO_EFFECT: &str = "Accepted for compatibility, no effect in tent-rs";

#[test]
fn the_readme_documents_exactly_the_keys_the_settings_read_with_their_defaults() {
    let tables = readme_tables();
    let used = tables.get(USED).expect("a ## Keys table");
    let no_effect = tables.get(NO_EFFECT).expect("a table of keys without effect");
    let schema = Settings::schema();
    let mut problems = Vec::new();
    for spec in &schema {
        let (table, other, name) = match spec.effect {
            Effect::Used => (used, no_effect, USED),
            Effect::NoEffect(_) => (no_effect, used, NO_EFFECT),
        };
        match table.get(spec.path) {
            Some(cell) => check_default(spec, cell, &mut problems),
            None if other.contains_key(spec.path) => problems
                .push(format!("{} is documented in the wrong table (the code puts it under {name:?})", spec.path)),
            None => problems.push(format!("{} is read by the settings but not documented", spec.path)),
        }
    }
    for key in used.keys().chain(no_effect.keys()) {
        if !schema.iter().any(|s| s.path == key) {
            problems.push(format!("{key} is documented but the settings do not know it"));
        }
    }
    assert!(problems.is_empty(), "config/README.md and src/config/settings.rs disagree:\n{}", problems.join("\n"));
}

/// The leaf paths of the sample file (arrays, null and the insides of opaque keys are leaves).
fn leaves(prefix: &str, v: &Value, schema: &[KeySpec], out: &mut BTreeMap<String, Value>) {
    let opaque = schema.iter().any(|s| s.path == prefix && s.opaque);
    match v {
        Value::Object(map) if !opaque => {
            for (k, child) in map {
                let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}/{k}") };
                leaves(&path, child, schema, out);
            }
        }
        _ => {
            out.insert(prefix.to_string(), v.clone());
        }
    }
}

#[test]
fn the_sample_file_holds_every_key_with_its_default() {
    let text = std::fs::read_to_string(root().join("config/transfer-engine.json")).expect("sample file");
    let sample: Value = serde_json::from_str(&text).expect("the sample file is JSON");
    let schema = Settings::schema();
    let mut found = BTreeMap::new();
    leaves("", &sample, &schema, &mut found);
    let mut problems = Vec::new();
    for spec in &schema {
        match found.get(spec.path) {
            // Machine-dependent defaults are `null` in the sample: "the code decides".
            Some(v) if spec.default_text.is_some() && v.is_null() => {}
            Some(v) if same(v, &spec.default) => {}
            Some(v) => problems.push(format!("{}: the sample says {v}, the code {}", spec.path, spec.default)),
            None => problems.push(format!("{} is missing from the sample file", spec.path)),
        }
    }
    for key in found.keys() {
        if !schema.iter().any(|s| s.path == key) {
            problems.push(format!("{key} is in the sample file but the settings do not know it"));
        }
    }
    assert!(problems.is_empty(), "config/transfer-engine.json and the settings disagree:\n{}", problems.join("\n"));
    // And the sample itself parses with no error and no warning.
    let (_, notes) = Settings::parse(&tent::config::Config::from_value(sample)).expect("the sample parses");
    assert!(notes.warnings.is_empty(), "{:?}", notes.warnings);
}

/// The calls that read the config tree by path.
const PATH_READS: [&str; 9] = [
    ".get_u64(",
    ".get_i64(",
    ".get_f64(",
    ".get_bool(",
    ".get_str(",
    ".get_string(",
    ".get_str_list(",
    ".get_i64_checked(",
    "config().get(",
];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("source folder").flatten() {
        let p = entry.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_code_outside_the_config_module_reads_the_tree_by_path() {
    let mut files = Vec::new();
    for dir in ["src", "python/src", "libs"] {
        rust_files(&root().join(dir), &mut files);
    }
    let config = root().join("src/config");
    let mut hits = Vec::new();
    for f in files {
        if f == root().join("src/config.rs") || f.starts_with(&config) {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read source");
        // Unit tests may inspect a tree they built; the code they test may not.
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for (n, line) in code.lines().enumerate() {
            if PATH_READS.iter().any(|p| line.contains(p)) {
                hits.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(hits.is_empty(), "config read by path outside src/config:\n{}", hits.join("\n"));
}
