//! `harness ui`'s response times (issue 24: each view within 500 ms on a store of 500 runs x
//! 10k metrics): a store of 500 runs, each with a resolved config and 10 metrics x 1000 steps
//! (5M metric rows), 40 of them the trials of a sweep, served in-process by the run browser and
//! asked for every view over HTTP, as the page asks.
//!
//! The store is built once into `target/ui-bench/` (about a minute) and kept for later runs.
//! `cargo bench -p rl-harness --bench ui`; docs/perf.md has the figures.

use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use rl_harness::config::{self, ExperimentConfig};
use rl_harness::{GenerationRow, Store};

mod common;
use common::KEYS;

const RUNS: usize = 500;
const STEPS: u64 = 1000;
const SWEEP_TRIALS: usize = 40;
/// Bumped when what the store holds changes, so that a kept store is built again.
const STORE_VERSION: u32 = 2;

/// Records run `i` (a resolved config varying by project, seed and learning rate).
async fn record_run(store: &Store, i: usize) -> i64 {
    let mut cfg = ExperimentConfig::default();
    cfg.trainer.project_name = format!("project-{}", i % 5);
    cfg.trainer.experiment_name = format!("run-{i}");
    cfg.trainer.seed = (i % 3) as u64;
    let cfg_json = config::to_json(&cfg).unwrap();
    let mut flat: serde_json::Value = serde_json::from_str(&cfg_json).unwrap();
    flat["actor_rollout_ref"]["actor"]["optim"]["lr"] =
        serde_json::json!(1e-6 * (1 + i % 7) as f64);
    let (name, project, seed) = (
        cfg.trainer.experiment_name.clone(),
        cfg.trainer.project_name.clone(),
        cfg.trainer.seed as i64,
    );
    let status = match i % 50 {
        0 => "failed",
        1 => "running",
        _ => "finished",
    };
    let sweep = (i < SWEEP_TRIALS).then(|| "lr-sweep".to_string());
    let trial = sweep.as_ref().map(|_| format!("trial{i:03}"));
    store
        .write(move |c| {
            Box::pin(async move {
                let t = 1.79e9 + i as f64 * 100.0;
                let id: i64 = sqlx::query_scalar(
                    "INSERT INTO runs (name, project, status, config, host, pid, seed, run_dir, \
                     created, started, ended, heartbeat, heartbeat_s, sweep_id, trial_id) \
                     VALUES (?, ?, ?, ?, 'bench', 1, ?, '', ?, ?, ?, ?, 5, ?, ?) RETURNING id",
                )
                .bind(name)
                .bind(project)
                .bind(status)
                .bind(flat.to_string())
                .bind(seed)
                .bind(t)
                .bind(t)
                .bind((status != "running").then_some(t + 90.0))
                .bind(t + 90.0)
                .bind(sweep)
                .bind(trial)
                .fetch_one(&mut *c)
                .await?;
                Ok(id)
            })
        })
        .await
        .unwrap()
}

/// Builds the store at `db` (5M metric rows through the store's own writer).
fn build(rt: &tokio::runtime::Runtime, db: &Path) {
    let _ = std::fs::remove_file(db);
    let store = rt.block_on(Store::open(db)).unwrap();
    rt.block_on(store.write(|c| {
        Box::pin(async move {
            sqlx::query(
                "INSERT INTO sweeps (id, name, spec, file, created) VALUES \
                 ('lr-sweep', 'lr-sweep', '{\"metric\": \"val/test_score\"}', 'x.toml', 0)",
            )
            .execute(&mut *c)
            .await?;
            Ok(0)
        })
    }))
    .unwrap();
    for i in 0..RUNS {
        let run = rt.block_on(record_run(&store, i));
        for step in 0..STEPS {
            let x = step as f64 / STEPS as f64;
            let m: Vec<(String, f64)> = KEYS
                .iter()
                .enumerate()
                .map(|(k, key)| {
                    (
                        key.to_string(),
                        (k as f64 + 1.0) * (1.0 - x) + (i % 17) as f64 * 0.01 * x,
                    )
                })
                .collect();
            store
                .log_metrics(run, step, m.iter().map(|(k, v)| (k, v)))
                .unwrap();
        }
        if i < SWEEP_TRIALS {
            let lr = 1e-6 * (1 + i % 7) as f64;
            let params = serde_json::json!({ "actor_rollout_ref.actor.optim.lr": lr });
            let trial = format!("trial{i:03}");
            rt.block_on(store.write(move |c| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO trials (sweep_id, trial_id, idx, params, state, run_id) \
                         VALUES ('lr-sweep', ?, ?, ?, 'finished', ?)",
                    )
                    .bind(trial)
                    .bind(i as i64)
                    .bind(params.to_string())
                    .bind(run)
                    .execute(&mut *c)
                    .await?;
                    Ok(0)
                })
            }))
            .unwrap();
        }
        if i == 0 {
            let rows: Vec<GenerationRow> = (0..64)
                .map(|g| GenerationRow {
                    step: (g / 16) * 250,
                    data_source: "arithmetic".into(),
                    prompt: format!("What is {g} + {g}?"),
                    response: format!("{}", 2 * g),
                    score: 1.0,
                })
                .collect();
            rt.block_on(store.write(move |c| {
                Box::pin(async move {
                    for step in [0u64, 250, 500, 750] {
                        let at: Vec<GenerationRow> = rows
                            .iter()
                            .filter(|g| g.step == step as i64)
                            .cloned()
                            .collect();
                        Store::insert_generations(c, run, step, &at).await?;
                    }
                    Ok(0)
                })
            }))
            .unwrap();
        }
        if i % 50 == 49 {
            rt.block_on(store.flush()).unwrap();
            eprintln!("ui bench: {} of {RUNS} runs written", i + 1);
        }
    }
    rt.block_on(store.flush()).unwrap();
}

/// `target/ui-bench/harness.db`, built unless a complete one is there.
fn store_path(rt: &tokio::runtime::Runtime) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.ancestors().nth(3).unwrap().join("ui-bench");
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("harness.db");
    let stamp = dir.join(format!("complete-{RUNS}x{STEPS}-v{STORE_VERSION}"));
    if !stamp.exists() {
        let start = std::time::Instant::now();
        build(rt, &db);
        std::fs::write(&stamp, "").unwrap();
        eprintln!("ui bench: store built in {:.0?}", start.elapsed());
    }
    db
}

fn bench(c: &mut Criterion) {
    let rt = common::runtime();
    let db = store_path(&rt);
    let running = rt
        .block_on(rl_harness::ui::start(&rl_harness::ui::Options {
            db,
            host: "127.0.0.1".parse().unwrap(),
            port: 0,
        }))
        .unwrap();
    let base = format!("http://{}", running.addr);
    let client = reqwest::blocking::Client::new();
    let get = |path: &str| {
        let r = client.get(format!("{base}{path}")).send().unwrap();
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.bytes().unwrap().len()
    };
    let views = [
        ("runs table (500 runs)", "/api/runs".to_string()),
        (
            "runs table, filtered",
            "/api/runs?filter=trainer.project_name%20%3D%20'project-1'%20and%20val%2Ftest_score%20%3E%200.05".to_string(),
        ),
        ("metric keys of 2 runs", "/api/keys?run=1,2".to_string()),
        ("metric keys of all runs", "/api/keys".to_string()),
        (
            "chart: 2 runs x 1 metric",
            "/api/series?run=1&run=2&key=actor/pg_loss".to_string(),
        ),
        (
            "chart: 5 runs x 3 metrics",
            "/api/series?run=1,2,3,4,5&key=actor/pg_loss&key=val/test_score&key=actor/entropy".to_string(),
        ),
        ("run page", "/api/run/1".to_string()),
        ("config diff of 5 runs", "/api/diff?run=1,2,3,4,5".to_string()),
        ("sweeps", "/api/sweeps".to_string()),
        ("sweep ranking (40 trials)", "/api/sweep/lr-sweep".to_string()),
        ("page (index.html)", "/".to_string()),
    ];
    let mut group = c.benchmark_group("ui");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for (name, path) in &views {
        let bytes = get(path);
        eprintln!("ui bench: {name}: {path} answers {bytes} bytes");
        group.bench_function(*name, |b| b.iter(|| get(path)));
    }
    group.finish();
    drop(running);
}

criterion_group!(benches, bench);
criterion_main!(benches);
