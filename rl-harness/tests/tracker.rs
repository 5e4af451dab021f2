//! The MLflow tracker against a real `mlflow server` (from PyPI, installed by
//! `scripts/mlflow-env` into `.venv-mlflow/`), started once for this test binary on 127.0.0.1
//! with a SQLite backend. Runs are read back through MLflow's REST API. The server is also
//! stopped in the middle of a run: training must finish regardless, and `harness sync` must
//! catch up once the server is back.
//!
//! The server lives in a `static`, which is never dropped, so it is a [`Tied`]: it and every
//! process it starts (uvicorn, the job runner, the huey consumers) are SIGKILLed when the test
//! binary ends, however it ends.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::{BANDIT, Env, Tied, wait_for};
use serde_json::Value;

struct Server {
    /// `None` while a test has it stopped.
    process: Option<Tied>,
    port: u16,
    dir: PathBuf,
}

fn mlflow_bin() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = root.join(".venv-mlflow/bin/mlflow");
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/mlflow-env first (scripts/test does)",
        bin.display()
    );
    bin
}

fn start(port: u16, dir: &Path) -> Tied {
    let log = std::fs::File::create(dir.join(format!(
        "server-{}.log",
        Instant::now().elapsed().as_nanos()
    )))
    .unwrap();
    Tied::spawn(
        Tied::command(mlflow_bin())
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
            .arg("--default-artifact-root")
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
        "{BANDIT}{extra}\n[trainer.tracker]\nkind = \"mlflow\"\nuri = \"http://127.0.0.1:{port}\"\nexperiment = \"harness-test\"\ntimeout_s = 2\ninterval_s = 0.5\nflush_timeout_s = 5\n"
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
    assert_eq!(params.len(), keys, "every config key is a param");
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
        .block_on(rl_harness::tracker::pending(&store, 1))
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
        .block_on(rl_harness::tracker::pending(&store, 1))
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
        rt.block_on(rl_harness::tracker::pending(&store, 1))
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
    ]);
    let (rt, store) = env.store();
    let first = remote_run_id(&rt, &store, 1);
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
}
