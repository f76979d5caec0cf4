//! The C boundary's house rules, checked against the source of `src/ffi/`: every export is
//! written out as `#[unsafe(no_mangle)] pub [unsafe] extern "C" fn` (so cbindgen sees it) and
//! its body is the panic guard and nothing else, so no code of an export runs outside it.
//! What an export returns when its guard takes over is pinned by the C and Rust tests of each.

mod common;

/// The position just past the `}` that closes the `{` at `open`, skipping string literals and
/// line comments.
fn block_end(text: &str, open: usize) -> usize {
    let bytes = text.as_bytes();
    let (mut depth, mut i) = (0usize, open);
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    panic!("unbalanced braces after byte {open}");
}

/// Each export of `text` (a file of `src/ffi/`): its name, how its item starts and its body
/// without comment lines.
fn exports(text: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let mut rest = 0;
    while let Some(at) = text[rest..].find("#[unsafe(no_mangle)]") {
        let item = rest + at + "#[unsafe(no_mangle)]".len();
        let sig_end = item + text[item..].find('(').expect("an export's parameter list");
        let head = text[item..sig_end].trim().to_string();
        let name = head.rsplit(' ').next().unwrap_or_default().to_string();
        // The body opens at the first `{` after the parameter list's closing parenthesis.
        let mut depth = 0i32;
        let mut open = sig_end;
        for (k, c) in text[sig_end..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                '{' if depth == 0 => {
                    open = sig_end + k;
                    break;
                }
                _ => {}
            }
        }
        let end = block_end(text, open);
        let body: Vec<&str> =
            text[open + 1..end - 1].lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with("//")).collect();
        out.push((name, head, body.join("\n")));
        rest = end;
    }
    out
}

/// Whether `body` is one `guard!(...)` call and nothing else.
fn is_only_a_guard(body: &str) -> bool {
    if !body.starts_with("guard!(") {
        return false;
    }
    // The guard's own parentheses close at the end of the body.
    let mut depth = 0i32;
    for (k, c) in body.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return body[k + 1..].trim().is_empty();
                }
            }
            _ => {}
        }
    }
    false
}

#[test]
fn every_export_is_written_out_with_its_body_in_the_guard() {
    let dir = common::root().join("src/ffi");
    let mut seen = 0;
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("src/ffi").flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read");
        for (name, head, body) in exports(&text) {
            seen += 1;
            let file = path.file_name().unwrap_or_default().to_string_lossy();
            if !(head.starts_with("pub unsafe extern \"C\" fn ") || head.starts_with("pub extern \"C\" fn ")) {
                wrong.push(format!("{file}: {name} is declared `{head}`"));
            }
            if !is_only_a_guard(&body) {
                wrong.push(format!("{file}: the body of {name} is not the guard alone:\n{body}"));
            }
        }
    }
    // Both headers' functions (49 + 38), all of them written in src/ffi.
    assert_eq!(seen, 87, "exports found in src/ffi");
    assert!(wrong.is_empty(), "exports that break the house rules:\n{}", wrong.join("\n"));
}

#[test]
fn the_check_sees_code_outside_the_guard() {
    let text = "#[unsafe(no_mangle)]\npub extern \"C\" fn a(x: i32) -> i32 {\n    guard!(\"a\", -1, { Ok(x) })\n}\n\
                #[unsafe(no_mangle)]\npub extern \"C\" fn b(x: *mut u8) -> u64 {\n    if x.is_null() { return 1; }\n    \
                guard!(\"b\", 0, { Ok(2) })\n}\n\
                #[unsafe(no_mangle)]\npub extern \"C\" fn c() {\n    guard!(\"c\", (), { Ok(()) });\n    let _ = \"}\";\n}\n";
    let found = exports(text);
    let names: Vec<&str> = found.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(names, ["a", "b", "c"]);
    let only: Vec<bool> = found.iter().map(|(_, _, b)| is_only_a_guard(b)).collect();
    assert_eq!(only, [true, false, false]);
}
