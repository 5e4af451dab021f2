//! Run-store costs: logging 100k metrics (the time the training loop spends queueing them, and
//! the time until they are committed), and `compare` over 50 runs x 10k metrics.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use rl_core::StepMetrics;
use rl_harness::Store;
use rl_harness::analysis::compare::{self, Mode};

mod common;
use common::KEYS;

async fn new_run(store: &Store, name: &str) -> i64 {
    let name = name.to_string();
    store
        .write(move |c| {
            Box::pin(async move {
                let id: i64 = sqlx::query_scalar(
                    "INSERT INTO runs (name, project, status, config, host, seed, run_dir, created, heartbeat_s) \
                     VALUES (?, 'bench', 'finished', ?, 'bench', 0, '', 0, 5) RETURNING id",
                )
                .bind(name)
                .bind(serde_json::json!({"trainer": {"seed": 0}}).to_string())
                .fetch_one(&mut *c)
                .await?;
                Ok(id)
            })
        })
        .await
        .unwrap()
}

/// Logs `steps` x 10 metrics; returns (time to queue them, time until committed).
fn log(rt: &tokio::runtime::Runtime, store: &Store, run: i64, steps: u64) -> (Duration, Duration) {
    let start = Instant::now();
    for step in 0..steps {
        let m: StepMetrics = KEYS
            .iter()
            .enumerate()
            .map(|(i, k)| (k.to_string(), step as f64 * 0.001 + i as f64))
            .collect();
        store.log_metrics(run, step, &m).unwrap();
    }
    let queued = start.elapsed();
    rt.block_on(store.flush()).unwrap();
    (queued, start.elapsed())
}

fn bench(c: &mut Criterion) {
    let rt = common::runtime();
    let dir = tempfile::tempdir().unwrap();
    let store = rt
        .block_on(Store::open(&dir.path().join("harness.db")))
        .unwrap();

    let mut group = c.benchmark_group("store");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(20));
    let mut queued_total = Duration::ZERO;
    let mut n = 0u32;
    group.bench_function("log 100k metrics: queue + commit", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let run = rt.block_on(new_run(&store, "log"));
                let (queued, committed) = log(&rt, &store, run, 10_000);
                queued_total += queued;
                n += 1;
                total += committed;
            }
            total
        })
    });
    eprintln!(
        "store/log 100k metrics: queueing (the time added to the training loop) averaged {:?}",
        queued_total / n.max(1)
    );

    // 50 runs x 10k metrics (1000 steps x 10 keys).
    let dir2 = tempfile::tempdir().unwrap();
    let store2 = rt
        .block_on(Store::open(&dir2.path().join("harness.db")))
        .unwrap();
    let mut runs = Vec::new();
    for i in 0..50 {
        let id = rt.block_on(new_run(&store2, &format!("r{i}")));
        log(&rt, &store2, id, 1000);
        runs.push(rt.block_on(store2.run(id)).unwrap().unwrap());
    }
    let metrics = vec!["val/test_score".to_string(), "actor/pg_loss".to_string()];
    group.bench_function("compare 50 runs x 10k metrics (2 metrics)", |b| {
        b.iter(|| {
            black_box(
                rt.block_on(compare::report(
                    &store2,
                    &runs,
                    &metrics,
                    Mode::Auto,
                    Some(500),
                ))
                .unwrap(),
            )
        })
    });
    group.bench_function("compare 50 runs x 10k metrics (every shared metric)", |b| {
        b.iter(|| {
            let all = rt
                .block_on(compare::common_metrics(&store2, &runs))
                .unwrap();
            black_box(
                rt.block_on(compare::report(&store2, &runs, &all, Mode::Auto, None))
                    .unwrap(),
            )
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
