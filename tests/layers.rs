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

#[path = "layers/uses.rs"]
mod uses;

/// The circles of files in the crate rooted at `root` (two or more files that use each other's
/// names, directly or round a longer loop), each with the uses that close it.
fn circles_in(root: &Path, skip: &[std::path::PathBuf]) -> Vec<String> {
    let krate = uses::Crate::read(root, skip);
    let edges = krate.edges();
    let base = root.parent().expect("folder");
    let show = |p: &Path| p.strip_prefix(base).unwrap_or(p).display().to_string();
    uses::circles(&edges)
        .into_iter()
        .map(|group| {
            let inside: Vec<String> = edges
                .iter()
                .filter(|e| group.contains(&e.from) && group.contains(&e.to))
                .map(|e| format!("    {} uses {} of {}", show(&e.from), e.name, show(&e.to)))
                .collect();
            let names: Vec<String> = group.iter().map(|p| show(p)).collect();
            format!("{}\n{}", names.join(", "), inside.join("\n"))
        })
        .collect()
}

/// Circles of files that are still to be taken apart (issue 54); the list only shrinks.
const KNOWN_CIRCLES: &[&str] = &[];

#[test]
fn no_circle_of_files() {
    let src = common::root().join("src");
    let bins = src.join("bin");
    let mut found = circles_in(&src.join("lib.rs"), std::slice::from_ref(&bins));
    for e in std::fs::read_dir(&bins).expect("src/bin").flatten() {
        let main = e.path().join("main.rs");
        if main.exists() {
            found.extend(circles_in(&main, &[]).into_iter().map(|c| format!("[{}] {c}", e.file_name().display())));
        }
    }
    let unknown: Vec<&String> =
        found.iter().filter(|c| !KNOWN_CIRCLES.iter().any(|k| c.lines().next() == Some(*k))).collect();
    assert!(
        unknown.is_empty(),
        "files that use each other's names:\n{}",
        unknown.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn the_check_sees_a_circle_and_follows_re_exports() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("layers-circle");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("a")).expect("mkdir");
    let write = |p: &str, t: &str| std::fs::write(dir.join(p), t).expect("write");
    write("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n");
    // a/mod.rs re-exports a/x.rs's X: b uses X of a/x.rs, not of a/mod.rs.
    write("a/mod.rs", "mod x;\npub use x::X;\npub struct Top;\n");
    write("a/x.rs", "pub struct X;\nuse crate::c::C; // a comment naming crate::b::B\n");
    write("b.rs", "use crate::a::X;\npub struct B;\n#[cfg(test)]\nmod tests { use crate::c::C; }\n");
    write("c.rs", "pub struct C;\nfn f() -> crate::a::X { let s = \"crate::b::B\"; todo!() }\n");
    let found = circles_in(&dir.join("lib.rs"), &[]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("a/x.rs, c.rs\n"), "{}", found[0]);
    // The child's `use super::Top` of a name its parent defines closes a circle too.
    write("a/x.rs", "pub struct X;\nuse super::Top;\n");
    write("a/mod.rs", "mod x;\npub use x::X;\npub struct Top;\nfn g(_: x::X) {}\n");
    let found = circles_in(&dir.join("lib.rs"), &[]);
    assert!(found.iter().any(|c| c.starts_with("a/mod.rs, a/x.rs\n")), "{found:?}");
}

/// What of the crate a file of `verbs` names besides `verbs` itself, `error` and `device`: the
/// verbs layer could stand as a crate of its own, so the layers above hand it plain values.
fn verbs_reaches_out(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let named: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !["verbs", "error", "device"].contains(&named.as_str()) {
                out.push((n + 1, named));
            }
        }
    }
    out
}

#[test]
fn verbs_uses_only_error_and_device() {
    let dir = common::root().join("src/verbs");
    let mut all = Vec::new();
    files(&dir, &mut all);
    let mut found = Vec::new();
    for f in &all {
        let text = std::fs::read_to_string(f).expect("read");
        for (n, named) in verbs_reaches_out(&text) {
            found.push(format!("{}:{n}: verbs names {named}", f.display()));
        }
    }
    assert!(found.is_empty(), "the verbs layer reaches above error and device:\n{}", found.join("\n"));
    assert_eq!(verbs_reaches_out("use crate::config::RdmaSection;"), vec![(1, "config".to_string())]);
    assert!(verbs_reaches_out("use crate::error::Result; crate::device::platform()").is_empty());
}
