//! tests/README.md says where a test of each kind goes and lists every file of this folder: the
//! list is checked here against the folder, so it stays true.

mod common;

use std::collections::BTreeSet;

#[test]
fn the_readme_lists_every_test_file() {
    let dir = common::root().join("tests");
    let readme = std::fs::read_to_string(dir.join("README.md")).expect("tests/README.md");
    let listed: BTreeSet<String> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(name, _)| name.to_string()))
        .filter(|name| name.ends_with(".rs"))
        .collect();
    let files: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("tests/")
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".rs"))
        .collect();
    let unlisted: Vec<&String> = files.difference(&listed).collect();
    let gone: Vec<&String> = listed.difference(&files).collect();
    assert!(unlisted.is_empty(), "test files tests/README.md does not list (add a row: kind, what): {unlisted:?}");
    assert!(gone.is_empty(), "tests/README.md lists files that are not in tests/: {gone:?}");
}
