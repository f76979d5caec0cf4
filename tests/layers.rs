//! The layer order of `src/lib.rs`, checked against the code: a file may name (`crate::...`)
//! only its own layer and the layers below it.

mod common;

use std::path::Path;

/// Layers from the top; `base` and the support modules are below all of them.
const ORDER: [&str; 5] = ["ffi", "engine", "transport", "control", "verbs"];
const BELOW_ALL: [&str; 7] = ["base", "device", "config", "error", "log", "metrics", "lib"];

fn layer_of(path: &Path, src: &Path) -> String {
    let rel = path.strip_prefix(src).expect("under src");
    let first = rel.components().next().map(|c| c.as_os_str().to_string_lossy().into_owned()).unwrap_or_default();
    first.trim_end_matches(".rs").to_string()
}

/// The rank of a layer: higher may use lower. Support and `base` are 0; `bin` is above all.
fn rank(layer: &str) -> usize {
    if layer == "bin" {
        return ORDER.len() + 1;
    }
    ORDER.iter().position(|l| *l == layer).map(|i| ORDER.len() - i).unwrap_or(0)
}

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The layers above its own that the text of a file in `layer` names (`crate::<layer>`).
fn upward_names(layer: &str, text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let named: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let known = ORDER.contains(&named.as_str()) || BELOW_ALL.contains(&named.as_str());
            if known && rank(&named) > rank(layer) {
                out.push((n + 1, named));
            }
        }
    }
    out
}

#[test]
fn no_import_goes_upward() {
    let src = common::root().join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut upward = Vec::new();
    for f in &all {
        let layer = layer_of(f, &src);
        let text = std::fs::read_to_string(f).expect("read");
        for (n, named) in upward_names(&layer, &text) {
            upward.push(format!("{}:{n}: {layer} names {named}", f.display()));
        }
    }
    assert!(upward.is_empty(), "imports that go up the layer order of src/lib.rs:\n{}", upward.join("\n"));
}

#[test]
fn the_check_sees_an_upward_import() {
    let transport =
        "use crate::control::client::RpcClient;\nuse crate::base::task::Task;\n    crate::engine::Engine::new";
    assert_eq!(upward_names("transport", transport), vec![(3, "engine".to_string())]);
    assert_eq!(upward_names("base", "use crate::verbs::Wc;"), vec![(1, "verbs".to_string())]);
    assert_eq!(upward_names("metrics", "crate::ffi::x; crate::config::Config"), vec![(1, "ffi".to_string())]);
    assert!(upward_names("ffi", "use crate::engine::Engine; use crate::base::x;").is_empty());
}
