//! Which file of a crate uses names which other file defines, read from the source text: the
//! graph behind the "no circle of files" rule of `tests/layers.rs`.
//!
//! A file uses a file when it imports (`use`) or names (`crate::..`, `super::..`, `self::..`)
//! something the other defines: an item at its top level, or the module itself. Paths are
//! followed through re-exports (`pub use`) to the file that defines the name, so a `mod.rs`
//! that only re-exports its children is not a hub. A `mod` declaration and a re-export are not
//! uses; neither is anything in `#[cfg(test)]` items, comments or string literals. External
//! crates are ignored. This is a reading of the text, not of the compiler's resolution: it is
//! exact for the plain paths this crate writes and errs towards seeing a use where unsure.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// A token of source text with comments and literals taken out.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// Tokens of `text` without comments, string, byte-string and char literals.
fn tokens(text: &str) -> Vec<Tok> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied().unwrap_or('\0');
        if ch == '/' && next == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if (ch == 'r' || (ch == 'b' && next == 'r')) && {
            let j = if ch == 'b' { i + 2 } else { i + 1 };
            let hashes = c[j.min(c.len())..].iter().take_while(|x| **x == '#').count();
            c.get(j + hashes) == Some(&'"') && (i == 0 || !ident_char(c[i - 1]))
        } {
            // A raw string: r"..", r#".."#, br"..".
            let j = if ch == 'b' { i + 2 } else { i + 1 };
            let hashes = c[j..].iter().take_while(|x| **x == '#').count();
            i = j + hashes + 1;
            loop {
                if i >= c.len() {
                    break;
                }
                if c[i] == '"' && c[i + 1..].iter().take(hashes).filter(|x| **x == '#').count() == hashes {
                    i += 1 + hashes;
                    break;
                }
                i += 1;
            }
        } else if ch == '"' || (ch == 'b' && next == '"' && (i == 0 || !ident_char(c[i - 1]))) {
            i += if ch == 'b' { 2 } else { 1 };
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
        } else if ch == '\'' {
            // A char literal ('a', '\n', '\u{1F600}') or a lifetime ('a, 'static).
            if next == '\\' {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
            }
        } else if ident_char(ch) {
            let start = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let word = word.strip_prefix("r#").map(str::to_string).unwrap_or(word);
            out.push(Tok::Ident(word));
        } else if ch == ':' && next == ':' {
            out.push(Tok::Path);
            i += 2;
        } else {
            if !ch.is_whitespace() {
                out.push(Tok::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

/// One `use` leaf: the path as written and whether it is a glob.
#[derive(Debug, Clone)]
struct UseLeaf {
    path: Vec<String>,
    alias: Option<String>,
    glob: bool,
}

/// What one file says.
#[derive(Debug, Default)]
struct FileFacts {
    /// Names of items at its top level.
    defines: BTreeSet<String>,
    /// Names it re-exports, with the path they stand for.
    reexports: Vec<UseLeaf>,
    /// Paths it imports or names.
    uses: Vec<UseLeaf>,
    /// Every identifier in its code (for glob imports).
    idents: BTreeSet<String>,
}

const ITEM_KEYWORDS: [&str; 9] = ["fn", "struct", "enum", "trait", "type", "const", "static", "union", "mod"];

/// Expands the use tree starting at `toks[*i]` with `prefix` into leaves; stops after the tree.
fn use_tree(toks: &[Tok], i: &mut usize, prefix: Vec<String>, out: &mut Vec<UseLeaf>) {
    let mut path = prefix;
    loop {
        match toks.get(*i) {
            Some(Tok::Ident(w)) => {
                path.push(w.clone());
                *i += 1;
                if toks.get(*i) == Some(&Tok::Path) {
                    *i += 1;
                    continue;
                }
                let mut alias = None;
                if toks.get(*i) == Some(&Tok::Ident("as".into())) {
                    if let Some(Tok::Ident(a)) = toks.get(*i + 1) {
                        alias = Some(a.clone());
                    }
                    *i += 2;
                }
                out.push(UseLeaf { path, alias, glob: false });
                return;
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push(UseLeaf { path, alias: None, glob: true });
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => use_tree(toks, i, path.clone(), out),
                    }
                }
            }
            _ => return,
        }
    }
}

/// Skips the item starting at `toks[*i]`: through its `;` or its balanced `{..}` block.
fn skip_item(toks: &[Tok], i: &mut usize) {
    let mut depth = 0usize;
    while *i < toks.len() {
        match &toks[*i] {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    *i += 1;
                    return;
                }
            }
            Tok::Punct(';') if depth == 0 => {
                *i += 1;
                return;
            }
            _ => {}
        }
        *i += 1;
    }
}

/// Reads what one file defines, re-exports and uses.
fn facts(text: &str) -> FileFacts {
    let toks = tokens(text);
    let mut f = FileFacts::default();
    let mut depth = 0usize;
    let mut i = 0;
    let ident = |t: Option<&Tok>| match t {
        Some(Tok::Ident(w)) => Some(w.clone()),
        _ => None,
    };
    while i < toks.len() {
        match &toks[i] {
            Tok::Punct('#') => {
                // An attribute: `#[cfg(test)]` (not `cfg(not(test))`) drops the item after it.
                let start = i;
                let mut j = i + 1;
                if toks.get(j) == Some(&Tok::Punct('!')) {
                    j += 1;
                }
                if toks.get(j) != Some(&Tok::Punct('[')) {
                    i += 1;
                    continue;
                }
                let mut d = 0;
                let mut words = Vec::new();
                while j < toks.len() {
                    match &toks[j] {
                        Tok::Punct('[') => d += 1,
                        Tok::Punct(']') => {
                            d -= 1;
                            if d == 0 {
                                break;
                            }
                        }
                        Tok::Ident(w) => words.push(w.clone()),
                        _ => {}
                    }
                    j += 1;
                }
                i = j + 1;
                let test_only = words.first().is_some_and(|w| w == "cfg")
                    && words.iter().any(|w| w == "test")
                    && !words.iter().any(|w| w == "not");
                if test_only && toks.get(start + 1) != Some(&Tok::Punct('!')) {
                    // Further attributes may stand between it and the item.
                    while toks.get(i) == Some(&Tok::Punct('#')) {
                        let mut d = 0;
                        i += 1;
                        while i < toks.len() {
                            match &toks[i] {
                                Tok::Punct('[') => d += 1,
                                Tok::Punct(']') => {
                                    d -= 1;
                                    if d == 0 {
                                        i += 1;
                                        break;
                                    }
                                }
                                _ => {}
                            }
                            i += 1;
                        }
                    }
                    skip_item(&toks, &mut i);
                }
            }
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(w) if w == "use" => {
                let public = i > 0 && {
                    // `pub use`, `pub(crate) use`, `pub(super) use`.
                    let back: Vec<&Tok> = toks[..i].iter().rev().take(4).collect();
                    back.first() == Some(&&Tok::Ident("pub".into()))
                        || (back.first() == Some(&&Tok::Punct(')')) && back.get(3) == Some(&&Tok::Ident("pub".into())))
                };
                i += 1;
                let mut leaves = Vec::new();
                if toks.get(i) == Some(&Tok::Path) {
                    i += 1;
                }
                use_tree(&toks, &mut i, Vec::new(), &mut leaves);
                if public && depth == 0 {
                    f.reexports.extend(leaves);
                } else {
                    f.uses.extend(leaves);
                }
            }
            Tok::Ident(w) if w == "macro_rules" && depth == 0 => {
                if let Some(name) = ident(toks.get(i + 2)) {
                    f.defines.insert(name);
                }
                i += 1;
            }
            Tok::Ident(w) if depth == 0 && ITEM_KEYWORDS.contains(&w.as_str()) => {
                let name = ident(toks.get(i + 1));
                match name {
                    // `const fn`, `unsafe fn`: the next keyword names it.
                    Some(n) if ITEM_KEYWORDS.contains(&n.as_str()) || n == "unsafe" || n == "extern" => {}
                    Some(n) if n != "_" => {
                        f.defines.insert(n);
                    }
                    _ => {}
                }
                i += 1;
            }
            Tok::Ident(w) if toks.get(i + 1) == Some(&Tok::Path) && (i == 0 || toks[i - 1] != Tok::Path) => {
                // An inline path: `super::core::Core::new`, `crate::base::qos::Level`, or one
                // from a child module (`lanes::Lane`); paths into other crates (`std::..`) are
                // dropped when resolved.
                f.idents.insert(w.clone());
                let mut path = vec![w.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::Path) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(n)) => {
                            path.push(n.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                // A path preceded by `::` belongs to a longer one already taken (`x::super::`
                // does not occur), and `pub(super)`/`pub(crate)` are visibilities.
                let visibility = i >= 2 && toks[i - 1] == Tok::Punct('(') && toks[i - 2] == Tok::Ident("pub".into());
                if !visibility && path.len() > 1 {
                    f.uses.push(UseLeaf { path, alias: None, glob: false });
                }
                i = j;
            }
            Tok::Ident(w) => {
                f.idents.insert(w.clone());
                i += 1;
            }
            _ => i += 1,
        }
    }
    f
}

/// The files of one crate and what each says.
pub struct Crate {
    /// Module path (without the `crate` root) -> file.
    modules: BTreeMap<Vec<String>, PathBuf>,
    /// File -> its module path.
    module_of: HashMap<PathBuf, Vec<String>>,
    facts: HashMap<PathBuf, FileFacts>,
}

/// A use of one file by another: the name that makes it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub from: PathBuf,
    pub to: PathBuf,
    pub name: String,
}

impl Crate {
    /// Reads the crate whose root file is `root` (`src/lib.rs`, `src/bin/x/main.rs`): every
    /// `.rs` file in the root's folder and below, except those of other crates (`skip`).
    pub fn read(root: &Path, skip: &[PathBuf]) -> Crate {
        let dir = root.parent().expect("root has a folder").to_path_buf();
        let mut files = Vec::new();
        collect(&dir, skip, &mut files);
        let mut modules = BTreeMap::new();
        let mut module_of = HashMap::new();
        let mut facts_of = HashMap::new();
        for file in files {
            let rel = file.strip_prefix(&dir).expect("under the root's folder");
            let mut parts: Vec<String> =
                rel.components().map(|c| c.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string()).collect();
            if file == root || parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            if file == root {
                parts.clear();
            }
            let text = std::fs::read_to_string(&file).expect("read a source file");
            facts_of.insert(file.clone(), facts(&text));
            modules.insert(parts.clone(), file.clone());
            module_of.insert(file, parts);
        }
        Crate { modules, module_of, facts: facts_of }
    }

    /// The module path `path` (as written in `file`) stands for, made absolute; `None` for
    /// paths into other crates.
    fn absolute(&self, file: &Path, path: &[String]) -> Option<Vec<String>> {
        let here = self.module_of.get(file)?.clone();
        let first = path.first()?;
        let mut out = match first.as_str() {
            "crate" => Vec::new(),
            "self" => here.clone(),
            "super" => {
                let mut m = here.clone();
                let mut k = 0;
                while path.get(k).is_some_and(|s| s == "super") {
                    m.pop();
                    k += 1;
                }
                m.extend(path[k..].iter().cloned());
                return Some(m);
            }
            // A path from a child module declared here, or from an item of this file.
            _ => {
                let mut child = here.clone();
                child.push(first.clone());
                let defined_here = self.facts.get(file).is_some_and(|f| f.defines.contains(first));
                if !self.modules.contains_key(&child) && !defined_here {
                    return None;
                }
                here.clone()
            }
        };
        let skip = usize::from(matches!(first.as_str(), "crate" | "self"));
        out.extend(path[skip..].iter().cloned());
        Some(out)
    }

    /// The file defining what the absolute path `abs` names, and the name (the module's own
    /// name for a module), following re-exports; `None` when it leaves the crate.
    fn resolve(&self, abs: &[String], hops: usize) -> Option<(PathBuf, String)> {
        if hops > 16 {
            return None;
        }
        // The longest prefix that is a file's module.
        let mut k = abs.len();
        while k > 0 && !self.modules.contains_key(&abs[..k]) {
            k -= 1;
        }
        let file = self.modules.get(&abs[..k])?.clone();
        let Some(name) = abs.get(k) else {
            return Some((file, abs.last().cloned().unwrap_or_else(|| "crate".into())));
        };
        let facts = self.facts.get(&file)?;
        if facts.defines.contains(name) {
            return Some((file, name.clone()));
        }
        for r in &facts.reexports {
            let exported = r.alias.as_ref().or(r.path.last());
            if !r.glob && exported == Some(name) {
                let mut target = self.absolute(&file, &r.path)?;
                target.extend(abs[k + 1..].iter().cloned());
                return self.resolve(&target, hops + 1);
            }
        }
        for r in facts.reexports.iter().filter(|r| r.glob) {
            let Some(mut target) = self.absolute(&file, &r.path) else { continue };
            target.push(name.clone());
            if let Some(found) = self.resolve(&target, hops + 1) {
                if found.0 != file {
                    return Some(found);
                }
            }
        }
        Some((file, name.clone()))
    }

    /// Every use of one file by another.
    pub fn edges(&self) -> BTreeSet<Edge> {
        let mut out = BTreeSet::new();
        for (file, facts) in &self.facts {
            for u in &facts.uses {
                let Some(abs) = self.absolute(file, &u.path) else { continue };
                if u.glob {
                    // A glob import uses the file it reads from when this file names
                    // something that file defines.
                    let Some((target, _)) = self.resolve(&abs, 0) else { continue };
                    let Some(tf) = self.facts.get(&target) else { continue };
                    if let Some(name) = tf.defines.iter().find(|d| facts.idents.contains(*d)) {
                        if target != *file {
                            out.insert(Edge { from: file.clone(), to: target, name: format!("{name} (glob)") });
                        }
                    }
                    continue;
                }
                if let Some((target, name)) = self.resolve(&abs, 0) {
                    if target != *file {
                        out.insert(Edge { from: file.clone(), to: target, name });
                    }
                }
            }
        }
        out
    }
}

fn collect(dir: &Path, skip: &[PathBuf], out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read_dir").flatten() {
        let p = e.path();
        if skip.iter().any(|s| p.starts_with(s)) {
            continue;
        }
        if p.is_dir() {
            collect(&p, skip, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The groups of files (two or more) that reach each other through uses: Tarjan's strongly
/// connected components of the use graph, each sorted, largest first.
pub fn circles(edges: &BTreeSet<Edge>) -> Vec<Vec<PathBuf>> {
    let mut next: BTreeMap<&PathBuf, Vec<&PathBuf>> = BTreeMap::new();
    for e in edges {
        next.entry(&e.from).or_default().push(&e.to);
        next.entry(&e.to).or_default();
    }
    struct State<'a> {
        index: HashMap<&'a PathBuf, usize>,
        low: HashMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(v: &'a PathBuf, next: &BTreeMap<&'a PathBuf, Vec<&'a PathBuf>>, s: &mut State<'a>) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in next.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(w, next, s);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut group = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                group.push(w.clone());
                if w == v {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                s.out.push(group);
            }
        }
    }
    let mut s = State {
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in next.keys() {
        if !s.index.contains_key(v) {
            visit(v, &next, &mut s);
        }
    }
    s.out.sort_by_key(|g| std::cmp::Reverse(g.len()));
    s.out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_leave_out_comments_and_literals() {
        let t = tokens("a /* b */ // c\n \"d::e\" r#\"f\"# 'g' 'static h::i b\"j\"");
        let words: Vec<String> = t
            .iter()
            .filter_map(|t| match t {
                Tok::Ident(w) => Some(w.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(words, ["a", "h", "i"]);
    }
}
