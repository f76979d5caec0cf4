//! Engine start cost: `cargo bench --bench engine_start` starts an engine 20 times (median
//! printed) from the sample config `config/transfer-engine.json` (every key set, so the whole
//! tree is read) on 127.0.0.1 with TCP and SHM, and times each start until `Engine::new`
//! returns; each engine is dropped before the next starts. Under `cargo test` it starts a few.
//! Options: `--rounds N`.

mod common;

use std::time::Instant;

use common::{arg, benching, median};
use tent::config::Config;
use tent::engine::{Engine, effective_config};

fn main() {
    let rounds = arg("--rounds").unwrap_or(if benching() { 20 } else { 3 }).max(1);
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/config/transfer-engine.json");
    let tree = Config::parse_text_or_path(sample).expect("the sample config parses");
    let mut starts = Vec::new();
    for _ in 0..rounds {
        let mut cfg = Config::from_value(tree.clone());
        cfg.set_from_string("rpc_server_hostname", "127.0.0.1");
        cfg.set_from_string("log_level", "warning");
        cfg.set_from_string("transports/shm/enable", "true");
        let t = Instant::now();
        let e = Engine::new(effective_config(cfg)).expect("engine starts");
        starts.push(t.elapsed().as_secs_f64() * 1e6);
        drop(e);
    }
    println!("engine start, sample config, {rounds} starts: median {:.0} us", median(starts));
    let mut cfg = Config::from_value(tree);
    cfg.apply_env();
    let parses: Vec<f64> = (0..rounds.max(200))
        .map(|_| {
            let t = Instant::now();
            let parsed = tent::config::Settings::parse(&cfg);
            let us = t.elapsed().as_secs_f64() * 1e6;
            assert!(parsed.is_ok(), "the sample config parses");
            us
        })
        .collect();
    println!("config parse into typed settings (sample config): median {:.1} us", median(parses));
}
