//! Throughput of the Python reward pool: scores per second for a trivial `compute_score`
//! (`return 1.0`) with 1, 2 and 4 workers on batches of 1024 rows (the figures of
//! docs/perf.md), and the same for a real scorer (verl's math-verify through the bridge).
//!
//!     cargo run --release -p rl-data --example reward_pool_bench [-- PYTHON]
//!
//! PYTHON defaults to `.venv-reward/bin/python` (`scripts/reward-env`), which the math-verify
//! rows need.

use std::time::Instant;

use rl_data::reward::python::{OnError, PoolSettings, PythonFunction, PythonPool};
use rl_data::reward::{RewardConfig, RewardRegistry, ScoreRow};
use serde_json::{Map, Value, json};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let python = std::env::args().nth(1).unwrap_or_else(|| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv-reward/bin/python").to_string()
    });
    let dir = std::env::temp_dir().join(format!("reward-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("trivial.py");
    std::fs::write(
        &file,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
    )?;
    let n = 1024;
    let responses: Vec<String> = (0..n)
        .map(|i| format!("Let me think step by step. ... The answer is $\\boxed{{{i}}}$."))
        .collect();
    let truths: Vec<Value> = (0..n).map(|i| json!(format!("{}", i % 3))).collect();
    let extra = json!({"split": "train", "index": 0});
    let rows: Vec<ScoreRow<'_>> = (0..n)
        .map(|i| ScoreRow {
            data_source: "openai/gsm8k",
            prompt: "",
            response: &responses[i],
            ground_truth: &truths[i],
            extra_info: &extra,
        })
        .collect();
    println!("batch of {n} rows, trivial compute_score (return 1.0), median of 5 batches:");
    for workers in [1, 2, 4] {
        let settings = PoolSettings {
            python: python.clone(),
            workers,
            timeout_s: 30.0,
            on_error: OnError::Raise,
        };
        let pool = PythonPool::start(
            PythonFunction::file(&file, "compute_score", Map::new()),
            settings,
        )?;
        pool.score_rows(&rows)?; // warm
        let mut rates: Vec<f64> = (0..5)
            .map(|_| {
                let t = Instant::now();
                pool.score_rows(&rows)
                    .map(|_| n as f64 / t.elapsed().as_secs_f64())
            })
            .collect::<Result<_, _>>()?;
        rates.sort_by(f64::total_cmp);
        println!(
            "  {workers} worker(s): {:>9.0} scores/s  ({:.2} ms per batch)",
            rates[2],
            n as f64 / rates[2] * 1e3
        );
    }
    println!("math-verify through the bridge (256 rows, one batch):");
    for workers in [1, 2, 4] {
        let cfg: RewardConfig = toml::from_str(&format!(
            "python = {python:?}\nworkers = {workers}\n[sources.bench]\nname = \"math_verify\"\n"
        ))?;
        let registry = RewardRegistry::with_config(&cfg)?;
        let part: Vec<ScoreRow<'_>> = rows[..256]
            .iter()
            .map(|r| ScoreRow {
                data_source: "bench",
                ..*r
            })
            .collect();
        registry.score_batch(&part[..workers])?; // starts the pool
        let t = Instant::now();
        registry.score_batch(&part)?;
        println!(
            "  {workers} worker(s): {:>9.0} scores/s",
            256.0 / t.elapsed().as_secs_f64()
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
