//! The MLflow tracker against a real `mlflow server` (from PyPI, installed by
//! `scripts/mlflow-env` into `.venv-mlflow/`), started once for this test binary on 127.0.0.1
//! with a SQLite backend. Runs are read back through MLflow's REST API. The server is also
//! stopped in the middle of a run: training must finish regardless, and `harness sync` must
//! catch up once the server is back. Answers lost after the server acted (through
//! [`LossyProxy`]) and two pushers at once must never double a run, a param or a metric value.
//!
//! The server lives in a `static`, which is never dropped, so it is a [`Tied`]: it and every
//! process it starts (uvicorn, the job runner, the huey consumers) are SIGKILLed when the test
//! binary ends, however it ends.

mod common;
mod lossy;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::{BANDIT, Env, Tied, wait_for};
use lossy::LossyProxy;
use serde_json::Value;

struct Server {
    /// `None` while a test has it stopped.
    process: Option<Tied>,
    port: u16,
    dir: PathBuf,
}

fn start(port: u16, dir: &Path) -> Tied {
    let log = std::fs::File::create(dir.join(format!(
        "server-{}.log",
        Instant::now().elapsed().as_nanos()
    )))
    .unwrap();
    Tied::spawn(
        Tied::command(common::venv_bin("mlflow"))
            .args([
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--workers",
                "1",
            ])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            // artifacts through the server's proxy (`mlflow-artifacts:` URIs), as by default
            .arg("--artifacts-destination")
            .arg(dir.join("artifacts"))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log),
    )
}

fn get(port: u16, path: &str) -> Option<Value> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    rt.block_on(async {
        let resp = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{port}{path}"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.json::<Value>().await.ok()
    })
}

fn wait_up(port: u16) {
    wait_for("mlflow server to answer", Duration::from_secs(180), || {
        get(port, "/api/2.0/mlflow/experiments/search?max_results=1").is_some()
    });
}

/// One server per test binary; tests that use it take the lock.
fn server() -> &'static Mutex<Server> {
    static S: OnceLock<Mutex<Server>> = OnceLock::new();
    S.get_or_init(|| {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap().keep();
        let process = Some(start(port, &dir));
        wait_up(port);
        Mutex::new(Server { process, port, dir })
    })
}

fn remote_run_id(rt: &tokio::runtime::Runtime, store: &rl_harness::Store, run: i64) -> String {
    rt.block_on(async {
        sqlx::query_scalar::<_, Option<String>>(
            "SELECT remote_run_id FROM tracker_runs WHERE run_id = ?",
        )
        .bind(run)
        .fetch_one(store.pool())
        .await
    })
    .unwrap()
    .expect("the run was created remotely")
}

fn history(port: u16, rid: &str, key: &str) -> Vec<(i64, f64)> {
    let mut out = Vec::new();
    let mut token = String::new();
    loop {
        let v = get(
            port,
            &format!("/api/2.0/mlflow/metrics/get-history?run_id={rid}&metric_key={}&max_results=25000{token}", key.replace('/', "%2F")),
        )
        .expect("metrics/get-history");
        for m in v["metrics"].as_array().cloned().unwrap_or_default() {
            out.push((
                m["step"].as_i64().unwrap_or(0),
                m["value"].as_f64().unwrap_or(f64::NAN),
            ));
        }
        match v["next_page_token"].as_str() {
            Some(t) if !t.is_empty() => token = format!("&page_token={t}"),
            _ => break,
        }
    }
    out.sort_by_key(|p| p.0);
    out
}

fn tracked_config(env: &Env, port: u16, extra: &str) -> String {
    let text = format!(
        "{BANDIT}{extra}\n[trainer.tracker]\nkind = \"mlflow\"\nuri = \"http://127.0.0.1:{port}\"\nexperiment = \"harness-test\"\ntimeout_s = 2\ninterval_s = 0.5\nflush_timeout_s = 60\n"
    );
    env.file("tracked.toml", &text)
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn runs_params_and_metrics_are_mirrored_to_mlflow() {
    let server = server().lock().unwrap_or_else(|e| e.into_inner());
    let port = server.port;
    let env = Env::new();
    // 150 steps x 9 metrics: more than one log-batch of 1000.
    let cfg = tracked_config(&env, port, "");
    env.ok(&[
        "train",
        &cfg,
        "trainer.total_training_steps=150",
        "trainer.save_freq=50",
    ]);
    let (rt, store) = env.store();
    let rid = remote_run_id(&rt, &store, 1);
    let run = get(port, &format!("/api/2.0/mlflow/runs/get?run_id={rid}")).expect("runs/get");
    assert_eq!(run["run"]["info"]["status"], "FINISHED", "{run}");
    let params = run["run"]["data"]["params"].as_array().unwrap();
    let stored = rt.block_on(store.run(1)).unwrap().unwrap().config;
    let keys = rl_harness::config::flatten(&serde_json::from_str(&stored).unwrap()).len();
    assert_eq!(
        params.len(),
        keys,
        "every config key is a param; events: {:?}",
        rt.block_on(store.events(1)).unwrap()
    );
    assert!(
        params
            .iter()
            .any(|p| p["key"] == "bandit.lr" && p["value"] == "0.05"),
        "{params:?}"
    );
    let local = rt.block_on(store.series(1, "critic/score/mean")).unwrap();
    assert_eq!(local.len(), 150);
    let remote = history(port, &rid, "critic/score/mean");
    assert_eq!(remote.len(), local.len());
    for ((s1, v1), (s2, v2)) in local.iter().zip(&remote) {
        assert_eq!(s1, s2);
        assert!((v1 - v2).abs() < 1e-9, "{v1} vs {v2}");
    }
    let pending = rt
        .block_on(rl_harness::integrations::tracker::pending(&store, 1))
        .unwrap();
    assert!(pending.is_empty(), "{pending:?}");
    assert!(env.ok(&["sync"]).contains("nothing pending"));
}

#[test]
fn a_server_stopped_mid_run_never_fails_training_and_sync_catches_up() {
    let mut server = server().lock().unwrap_or_else(|e| e.into_inner());
    let port = server.port;
    let env = Env::new();
    let cfg = tracked_config(&env, port, "");
    let child = env.spawn(&[
        "train",
        &cfg,
        "trainer.total_training_steps=40",
        "bandit.step_delay_ms=100",
    ]);
    wait_for("the run store", Duration::from_secs(60), || {
        env.db().exists()
    });
    let (rt, store) = env.store();
    wait_for(
        "the remote run and some metrics pushed",
        Duration::from_secs(60),
        || {
            rt.block_on(async {
                sqlx::query_scalar::<_, i64>(
                    "SELECT metric_cursor FROM tracker_runs WHERE run_id = 1",
                )
                .fetch_optional(store.pool())
                .await
            })
            .ok()
            .flatten()
            .unwrap_or(0)
                > 0
        },
    );
    // SIGKILLs the server and everything it started
    server.process = None;
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "training failed with the tracker down: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "training was held up: {:?}",
        started.elapsed()
    );
    let pending = rt
        .block_on(rl_harness::integrations::tracker::pending(&store, 1))
        .unwrap();
    assert!(
        !pending.is_empty(),
        "records must be pending while the server is down"
    );
    let err = env.fails(&["sync", "--timeout-s", "5"]);
    assert!(err.contains("tracker sync incomplete"), "{err}");

    server.process = Some(start(port, &server.dir.clone()));
    wait_up(port);
    let out = env.ok(&["sync"]);
    assert!(out.contains("run 1: pushed"), "{out}");
    assert!(
        rt.block_on(rl_harness::integrations::tracker::pending(&store, 1))
            .unwrap()
            .is_empty()
    );
    let rid = remote_run_id(&rt, &store, 1);
    let run = get(port, &format!("/api/2.0/mlflow/runs/get?run_id={rid}")).unwrap();
    assert_eq!(run["run"]["info"]["status"], "FINISHED", "{run}");
    let local = rt.block_on(store.series(1, "actor/pg_loss")).unwrap();
    assert_eq!(history(port, &rid, "actor/pg_loss").len(), local.len());
    assert_eq!(
        history(port, &rid, "val/test_score").len(),
        9,
        "steps 0, 5, ..., 40"
    );
}

#[test]
fn a_resume_that_drops_metrics_replaces_the_remote_copy_so_it_equals_the_store() {
    let server = server().lock().unwrap_or_else(|e| e.into_inner());
    let port = server.port;
    let env = Env::new();
    let cfg = tracked_config(&env, port, "");
    env.ok(&[
        "train",
        &cfg,
        "trainer.total_training_steps=20",
        "trainer.save_freq=5",
        "trainer.experiment_name=rewound",
        "trainer.log_val_generations=2",
    ]);
    let (rt, store) = env.store();
    let first = remote_run_id(&rt, &store, 1);
    assert_eq!(
        generation_files(port, &first).len(),
        5,
        "validations at 0, 5, .., 20"
    );
    assert_eq!(history(port, &first, "critic/score/mean").len(), 20);
    // steps 11..20 are dropped locally and trained again
    env.ok(&["resume", "1", "--from-step", "10"]);
    let second = remote_run_id(&rt, &store, 1);
    assert_ne!(first, second, "the remote run was not replaced");
    let local = rt.block_on(store.series(1, "critic/score/mean")).unwrap();
    let remote = history(port, &second, "critic/score/mean");
    assert_eq!(local.len(), 20);
    assert_eq!(
        remote.iter().map(|p| p.0).collect::<Vec<_>>(),
        local.iter().map(|p| p.0).collect::<Vec<_>>(),
        "the remote copy holds each step once"
    );
    for ((_, v1), (_, v2)) in local.iter().zip(&remote) {
        assert!((v1 - v2).abs() < 1e-9, "{v1} vs {v2}");
    }
    let old = get(port, &format!("/api/2.0/mlflow/runs/get?run_id={first}")).expect("runs/get");
    assert_eq!(old["run"]["info"]["lifecycle_stage"], "deleted", "{old}");
    let events = rt.block_on(store.events(1)).unwrap();
    assert!(events.iter().any(|e| e.kind == "tracker"), "{events:?}");
    // issue 19: the validation generations are artifacts of the remote run, one JSON file per
    // validation, the kept ones carried to the replacement
    assert_eq!(
        generation_files(port, &second),
        [0, 5, 10, 15, 20]
            .iter()
            .map(|s| format!("val_generations/step_{s:06}.json"))
            .collect::<Vec<_>>()
    );
    let run = get(port, &format!("/api/2.0/mlflow/runs/get?run_id={second}")).unwrap();
    let root = run["run"]["info"]["artifact_uri"].as_str().unwrap();
    let rel = root
        .strip_prefix("mlflow-artifacts:")
        .unwrap()
        .trim_matches('/');
    let remote = get(
        port,
        &format!("/api/2.0/mlflow-artifacts/artifacts/{rel}/val_generations/step_000020.json"),
    )
    .expect("the step-20 generations");
    let local: Vec<_> = rt
        .block_on(store.generations(1))
        .unwrap()
        .into_iter()
        .filter(|g| g.step == 20)
        .collect();
    assert_eq!(remote.as_array().map(Vec::len), Some(2), "{remote}");
    for (r, l) in remote.as_array().unwrap().iter().zip(&local) {
        assert_eq!(r["prompt"], l.prompt.as_str());
        assert_eq!(r["response"], l.response.as_str());
        assert_eq!(r["score"].as_f64(), Some(l.score));
    }
}

/// The paths of remote run `rid`'s validation-generation artifacts.
fn generation_files(port: u16, rid: &str) -> Vec<String> {
    let listed = get(
        port,
        &format!("/api/2.0/mlflow/artifacts/list?run_id={rid}&path=val_generations"),
    )
    .unwrap_or_default();
    let mut files: Vec<String> = listed["files"]
        .as_array()
        .map(|fs| {
            fs.iter()
                .filter_map(|f| f["path"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// Every remote run of experiment `harness-test` named `name`.
fn remote_runs_named(port: u16, name: &str) -> Vec<Value> {
    let exp = get(
        port,
        "/api/2.0/mlflow/experiments/get-by-name?experiment_name=harness-test",
    )
    .expect("the experiment exists");
    let id = exp["experiment"]["experiment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let v: Value = rt.block_on(async {
        reqwest::Client::new()
            .post(format!(
                "http://127.0.0.1:{port}/api/2.0/mlflow/runs/search"
            ))
            .json(&serde_json::json!({"experiment_ids": [id],
                "filter": format!("tags.`mlflow.runName` = '{name}'"), "max_results": 100}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    v["runs"].as_array().cloned().unwrap_or_default()
}

/// The remote copy of run 1 equals the store: one remote run, every param once, every metric
/// value once, finished, and nothing pending.
fn assert_mirrored_once(env: &Env, port: u16, name: &str) {
    let (rt, store) = env.store();
    let events = rt.block_on(store.events(1)).unwrap();
    let runs = remote_runs_named(port, name);
    assert_eq!(
        runs.len(),
        1,
        "one remote run for {name}: {runs:?}; events: {events:?}"
    );
    let rid = remote_run_id(&rt, &store, 1);
    assert_eq!(runs[0]["info"]["run_id"], rid.as_str());
    let run = get(port, &format!("/api/2.0/mlflow/runs/get?run_id={rid}")).expect("runs/get");
    assert_eq!(
        run["run"]["info"]["status"], "FINISHED",
        "events: {events:?}"
    );
    let stored = rt.block_on(store.run(1)).unwrap().unwrap().config;
    let keys = rl_harness::config::flatten(&serde_json::from_str(&stored).unwrap()).len();
    let params = run["run"]["data"]["params"].as_array().unwrap();
    assert_eq!(
        params.len(),
        keys,
        "every config key is a param once; events: {events:?}"
    );
    for key in ["critic/score/mean", "actor/pg_loss", "val/test_score"] {
        let local = rt.block_on(store.series(1, key)).unwrap();
        let remote = history(port, &rid, key);
        assert_eq!(
            remote.iter().map(|p| p.0).collect::<Vec<_>>(),
            local.iter().map(|p| p.0).collect::<Vec<_>>(),
            "{key}: each step once remotely; events: {events:?}"
        );
    }
    let pending = rt
        .block_on(rl_harness::integrations::tracker::pending(&store, 1))
        .unwrap();
    assert!(pending.is_empty(), "{pending:?}");
}

#[test]
fn answers_lost_after_the_server_acted_never_double_a_run_a_param_or_a_metric() {
    let server = server().lock().unwrap_or_else(|e| e.into_inner());
    // The first runs/create and every other log-batch (params and metrics) are carried out by
    // the server and their answers lost: each is a timeout-after-commit.
    let proxy = LossyProxy::start(
        server.port,
        Duration::ZERO,
        Box::new(|path, n| {
            (path.ends_with("/runs/create") && n == 1)
                || (path.ends_with("/runs/log-batch") && n % 2 == 1)
        }),
    );
    let env = Env::new();
    let cfg = tracked_config(&env, proxy.port, "");
    // The background push runs once at the start only (its interval outlasts the run), so
    // every metric batch goes out in the end-of-run flush, half of them with lost answers: the
    // flush must keep going while it makes progress (it gave up after three failures, and the
    // run stayed RUNNING remotely, whenever training was fast enough to leave several batches
    // to the flush).
    env.ok(&[
        "train",
        &cfg,
        "trainer.total_training_steps=150",
        "trainer.experiment_name=lossy",
        "trainer.tracker.interval_s=3600",
    ]);
    // At least the first create, the first params chunk (log-batch 1) and a metrics batch
    // (log-batch 3: the params' second chunk is 2) were lost.
    assert!(proxy.lost() >= 3, "only {} answers lost", proxy.lost());
    assert_mirrored_once(&env, server.port, "lossy-1");
}

#[test]
fn two_syncs_at_once_push_each_record_once() {
    let server = server().lock().unwrap_or_else(|e| e.into_inner());
    // Nothing listens on the run's tracker address: everything stays pending.
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let env = Env::new();
    let cfg = tracked_config(&env, closed, "");
    env.ok(&[
        "train",
        &cfg,
        "trainer.total_training_steps=150",
        "trainer.experiment_name=twice",
    ]);
    // Each answer held back 300 ms, so the two pushes overlap.
    let proxy = LossyProxy::start(
        server.port,
        Duration::from_millis(300),
        Box::new(|_, _| false),
    );
    let uri = format!("http://127.0.0.1:{}", proxy.port);
    let outs = env.at_once(2, &["sync", "--uri", &uri]);
    let texts: Vec<String> = outs
        .iter()
        .map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        })
        .collect();
    assert!(
        texts.iter().any(|t| t.contains("run 1: pushed")),
        "{texts:?}"
    );
    for (out, text) in outs.iter().zip(&texts) {
        assert!(
            out.status.success() || text.contains("is being pushed by another process (pid"),
            "a sync failed for another reason: {text}"
        );
    }
    // Whoever lost the race pushes nothing twice when run again.
    env.ok(&["sync", "--uri", &uri]);
    assert_mirrored_once(&env, server.port, "twice-1");
}
