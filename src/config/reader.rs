//! Reads typed values out of the config tree for [`super::Settings`], and records every key it
//! is asked for: its path, its default, its range and whether tent-rs acts on it. That record
//! is the schema: the documentation test, the unknown-key check and `Settings::schema` all use
//! it, so a key's path, type, default and range are written once, where the section reads it.

use std::collections::HashMap;

use serde_json::Value;

use super::Config;

/// Whether tent-rs acts on a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// The engine uses the value.
    Used,
    /// Accepted so that upstream configs load, but nothing in tent-rs reads it; the text says why.
    NoEffect(&'static str),
}

/// The values a key accepts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Range {
    /// An integer in `min..=max`.
    Int(i64, i64),
    /// A non-negative integer in `min..=max`.
    Uint(u64, u64),
    /// One of these words (any case).
    OneOf(&'static [&'static str]),
    /// A number in `min..=max`.
    Float(f64, f64),
}

impl std::fmt::Display for Range {
    /// `1..=1024`, or the words separated by commas.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Range::Int(a, b) => write!(f, "{a}..={b}"),
            Range::Uint(a, b) => write!(f, "{a}..={b}"),
            Range::OneOf(words) => f.write_str(&words.join(", ")),
            Range::Float(a, b) => write!(f, "{a}..={b}"),
        }
    }
}

/// One key of the schema.
#[derive(Debug, Clone, PartialEq)]
pub struct KeySpec {
    /// The `/` path.
    pub path: &'static str,
    /// The default as JSON (`null`: unset, the code decides).
    pub default: Value,
    /// The default in words, for defaults that depend on the machine (`None` otherwise).
    pub default_text: Option<&'static str>,
    /// The accepted values, if limited.
    pub range: Option<Range>,
    /// Whether tent-rs acts on it.
    pub effect: Effect,
    /// Its value is a structure read as a whole (a policy list, a matrix): the keys inside it
    /// are not config keys and are never reported as unknown.
    pub opaque: bool,
}

/// Reads values and records their specs. Every read gives a usable value: an ill-typed or
/// out-of-range one is recorded as an error (path, value, reason) and replaced by the default,
/// so one pass reports every mistake.
pub(crate) struct Reader<'a> {
    cfg: &'a Config,
    /// Record every key's spec (for the schema); parsing an engine's config needs none.
    recording: bool,
    pub(crate) specs: Vec<KeySpec>,
    pub(crate) errors: Vec<String>,
    pub(crate) warnings: Vec<String>,
}

/// A short rendering of a value for messages.
fn show(v: &Value) -> String {
    super::show(v)
}

impl<'a> Reader<'a> {
    /// A reader that records the schema while it reads.
    pub(crate) fn recording(cfg: &'a Config) -> Reader<'a> {
        Reader { cfg, recording: true, specs: Vec::new(), errors: Vec::new(), warnings: Vec::new() }
    }

    /// A reader that only reads (and reports errors and warnings).
    pub(crate) fn new(cfg: &'a Config) -> Reader<'a> {
        Reader { cfg, recording: false, specs: Vec::new(), errors: Vec::new(), warnings: Vec::new() }
    }

    /// The value at `path`, borrowed from the config (not from the reader, which is mutated
    /// while the value is looked at).
    fn lookup(&self, path: &str) -> Option<&'a Value> {
        let cfg: &'a Config = self.cfg;
        cfg.get(path)
    }

    fn push(&mut self, spec: KeySpec) {
        if self.recording {
            self.specs.push(spec);
        }
    }

    fn record(&mut self, path: &'static str, default: Value, range: Option<Range>) {
        self.push(KeySpec { path, default, default_text: None, range, effect: Effect::Used, opaque: false });
    }

    /// Refuses the value `v` of key `path` for `reason`: the parse fails with that sentence.
    pub(crate) fn fail(&mut self, path: &str, v: &Value, reason: &str) {
        self.errors.push(format!("config key {path}: {} {reason}", show(v)));
    }

    /// Whether the key is set (present and not null).
    pub(crate) fn is_set(&self, path: &str) -> bool {
        self.lookup(path).is_some()
    }

    /// A boolean: JSON booleans, 0/1, and true/false/yes/no/on/off in any case.
    pub(crate) fn bool(&mut self, path: &'static str, default: bool) -> bool {
        self.record(path, Value::Bool(default), None);
        let Some(v) = self.lookup(path) else {
            return default;
        };
        super::bool_of(v).unwrap_or_else(|| {
            self.fail(path, v, "is not a boolean (true, false, 1, 0, yes, no, on, off)");
            default
        })
    }

    /// A signed integer (a JSON integer or a string holding one) in `min..=max`.
    pub(crate) fn int(&mut self, path: &'static str, default: i64, min: i64, max: i64) -> i64 {
        self.record(path, Value::from(default), Some(Range::Int(min, max)));
        self.int_value(path, min, max).unwrap_or(default)
    }

    /// An integer that may stay unset (the legacy lane knobs): `None` when unset or bad.
    pub(crate) fn opt_int(&mut self, path: &'static str, min: i64, max: i64) -> Option<i64> {
        self.record(path, Value::Null, Some(Range::Int(min, max)));
        self.int_value(path, min, max)
    }

    fn int_value(&mut self, path: &'static str, min: i64, max: i64) -> Option<i64> {
        let v = self.lookup(path)?;
        let Some(n) = super::int_of(v) else {
            self.fail(path, v, "is not an integer");
            return None;
        };
        if n < min || n > max {
            self.fail(path, v, &format!("is outside the allowed range {min}..={max}"));
            return None;
        }
        Some(n)
    }

    /// A non-negative integer in `min..=max` (`u64` so that nanosecond timeouts fit).
    pub(crate) fn uint(&mut self, path: &'static str, default: u64, min: u64, max: u64) -> u64 {
        self.record(path, Value::from(default), Some(Range::Uint(min, max)));
        self.uint_value(path, min, max).unwrap_or(default)
    }

    /// Like [`Reader::uint`] for a key whose default depends on the machine, described in words.
    pub(crate) fn uint_computed(
        &mut self,
        path: &'static str,
        default: u64,
        text: &'static str,
        min: u64,
        max: u64,
    ) -> u64 {
        self.push(KeySpec {
            path,
            default: Value::Null,
            default_text: Some(text),
            range: Some(Range::Uint(min, max)),
            effect: Effect::Used,
            opaque: false,
        });
        self.uint_value(path, min, max).unwrap_or(default)
    }

    fn uint_value(&mut self, path: &'static str, min: u64, max: u64) -> Option<u64> {
        let v = self.lookup(path)?;
        let parsed = match &v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.trim().parse::<u64>().ok(),
            _ => None,
        };
        let Some(n) = parsed else {
            self.fail(path, v, "is not a non-negative integer");
            return None;
        };
        if n < min || n > max {
            self.fail(path, v, &format!("is outside the allowed range {min}..={max}"));
            return None;
        }
        Some(n)
    }

    /// A number (a JSON number or a string holding one) in `min..=max`.
    pub(crate) fn float(&mut self, path: &'static str, default: f64, min: f64, max: f64) -> f64 {
        self.record(path, Value::from(default), Some(Range::Float(min, max)));
        let Some(v) = self.lookup(path) else {
            return default;
        };
        match float_of(v) {
            Some(x) if (min..=max).contains(&x) => x,
            Some(_) => {
                self.fail(path, v, &format!("is outside the allowed range {min}..={max}"));
                default
            }
            None => {
                self.fail(path, v, "is not a number");
                default
            }
        }
    }

    /// Exactly `N` numbers, each in `min..=max`; unset or empty gives `default`.
    pub(crate) fn floats<const N: usize>(
        &mut self,
        path: &'static str,
        default: [f64; N],
        min: f64,
        max: f64,
    ) -> [f64; N] {
        self.record(path, Value::from(default.to_vec()), Some(Range::Float(min, max)));
        let Some(v) = self.lookup(path) else {
            return default;
        };
        let items: Option<Vec<f64>> = v.as_array().and_then(|a| a.iter().map(float_of).collect());
        if items.as_ref().is_some_and(Vec::is_empty) {
            // Upstream's sample writes `[]` for "the built-in values".
            return default;
        }
        match items.map(<[f64; N]>::try_from) {
            Some(Ok(xs)) if xs.iter().all(|x| (min..=max).contains(x)) => xs,
            _ => {
                self.fail(path, v, &format!("is not an array of {N} numbers in {min}..={max}"));
                default
            }
        }
    }

    /// A string. Numbers and booleans give their text, because `tent_set_config` stores
    /// `"1234"` as an integer and a segment name must survive that.
    pub(crate) fn string(&mut self, path: &'static str, default: &str) -> String {
        self.record(path, Value::from(default), None);
        self.string_value(path).unwrap_or_else(|| default.to_string())
    }

    fn string_value(&mut self, path: &'static str) -> Option<String> {
        let v = self.lookup(path)?;
        match v {
            Value::String(s) => Some(s.clone()),
            Value::Number(_) | Value::Bool(_) => Some(v.to_string()),
            other => {
                self.fail(path, other, "is not a string");
                None
            }
        }
    }

    /// One of `allowed` (compared without case), given back in lower case.
    pub(crate) fn choice(
        &mut self,
        path: &'static str,
        default: &'static str,
        allowed: &'static [&'static str],
    ) -> String {
        self.record(path, Value::from(default), Some(Range::OneOf(allowed)));
        let Some(s) = self.string_value(path) else {
            return default.to_string();
        };
        let lower = s.trim().to_ascii_lowercase();
        if allowed.contains(&lower.as_str()) {
            lower
        } else {
            self.fail(path, &Value::String(s), &format!("is not one of {}", allowed.join(", ")));
            default.to_string()
        }
    }

    /// An array of strings; unset is empty.
    pub(crate) fn str_list(&mut self, path: &'static str) -> Vec<String> {
        self.record(path, Value::Array(Vec::new()), None);
        let Some(v) = self.lookup(path) else {
            return Vec::new();
        };
        let items = match &v {
            Value::Array(items) => items.iter().map(|i| i.as_str().map(str::to_string)).collect::<Option<Vec<_>>>(),
            _ => None,
        };
        items.unwrap_or_else(|| {
            self.fail(path, v, "is not an array of strings");
            Vec::new()
        })
    }

    /// A structure read as a whole by the layer that owns it (`policy`); `None` when unset.
    pub(crate) fn raw(&mut self, path: &'static str, default: Value) -> Option<Value> {
        self.push(KeySpec { path, default, default_text: None, range: None, effect: Effect::Used, opaque: true });
        self.lookup(path).cloned()
    }

    /// A key accepted for compatibility that tent-rs does not act on. Setting it to something
    /// other than its default is reported as a warning saying why it has no effect.
    pub(crate) fn no_effect(&mut self, path: &'static str, default: Value, reason: &'static str) {
        let opaque = default.is_array() || default.is_object() || default.is_null();
        self.push(KeySpec {
            path,
            default: default.clone(),
            default_text: None,
            range: None,
            effect: Effect::NoEffect(reason),
            opaque,
        });
        if let Some(v) = self.lookup(path)
            && !same_value(v, &default)
        {
            self.warnings
                .push(format!("config key {path} is set to {} but has no effect in tent-rs: {reason}", show(v)));
        }
    }
}

/// A number, or a string holding one.
fn float_of(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok().filter(|x| x.is_finite()),
        _ => None,
    }
}

/// Whether a configured value equals a default, reading numbers, numeric strings and 0/1
/// booleans the way the getters do (so `"0"` equals `0` and `false`).
fn same_value(v: &Value, default: &Value) -> bool {
    if v == default {
        return true;
    }
    match default {
        Value::Bool(b) => super::bool_of(v) == Some(*b),
        Value::Number(n) => match (n.as_f64(), v) {
            (Some(d), Value::Number(m)) => m.as_f64() == Some(d),
            (Some(d), Value::String(s)) => s.trim().parse::<f64>().ok() == Some(d),
            _ => false,
        },
        Value::Array(a) if a.is_empty() => v.as_array().is_some_and(|x| x.is_empty()),
        Value::Null => v.is_null(),
        _ => false,
    }
}

/// The keys set in `tree` that no spec names, each with the nearest known path (by edit
/// distance) when one is close. Objects are walked down to their leaves, except below an
/// opaque key; a flat top-level key holding a `/` path counts as that path.
pub(crate) fn unknown_keys(tree: &Value, specs: &[KeySpec]) -> Vec<(String, Option<&'static str>)> {
    let index: HashMap<&str, bool> = specs.iter().map(|s| (s.path, s.opaque)).collect();
    let mut found = Vec::new();
    if let Value::Object(map) = tree {
        for (k, v) in map {
            walk(&mut k.trim_matches('/').to_string(), v, &index, &mut found);
        }
    }
    found
        .into_iter()
        .map(|path| {
            let nearest = specs
                .iter()
                .map(|s| (strsim::levenshtein(&path, s.path), s.path))
                .min()
                .filter(|(d, _)| *d <= (path.len() / 3).max(3))
                .map(|(_, p)| p);
            (path, nearest)
        })
        .collect()
}

/// Walks `v` at `path` (a buffer the walk extends and restores, so no path is allocated for
/// a known key).
fn walk(path: &mut String, v: &Value, index: &HashMap<&str, bool>, found: &mut Vec<String>) {
    if v.is_null() {
        return;
    }
    let known = index.get(path.as_str());
    if known.is_some_and(|opaque| *opaque || !v.is_object()) {
        return;
    }
    match v {
        Value::Object(map) => {
            for (k, child) in map {
                let len = path.len();
                path.push('/');
                path.push_str(k.trim_matches('/'));
                walk(path, child, index, found);
                path.truncate(len);
            }
        }
        // A leaf that no spec names is unknown.
        _ => found.push(path.clone()),
    }
}
