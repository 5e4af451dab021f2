//! Helpers shared by the harness's integration tests: run the `harness` binary in a temporary
//! folder, read its run store, wait for conditions with bounded time.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tch::Tensor;

mod tied;
pub use tied::Tied;

pub struct Env {
    pub dir: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Env {
        Env {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn db(&self) -> PathBuf {
        self.path().join("runs/harness.db")
    }

    /// Writes a file under the temp folder and returns its path.
    pub fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    pub fn cmd(&self) -> Command {
        self.harness(Command::new(env!("CARGO_BIN_EXE_harness")))
    }

    /// [`Env::cmd`] in a session of its own, for [`Tied::spawn`]: for a harness that could
    /// outlive the test (a server, a long run), as it dies with the test process.
    pub fn tied_cmd(&self) -> Command {
        self.harness(Tied::command(env!("CARGO_BIN_EXE_harness")))
    }

    fn harness(&self, mut c: Command) -> Command {
        c.current_dir(self.path())
            .env("RUST_LOG", "warn")
            .env_remove("RL_TRAINER__DB");
        c
    }

    /// Runs harness with `args`, returning the output.
    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().unwrap()
    }

    /// Runs harness and asserts success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "harness {args:?} failed:\nstdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs harness, asserts failure; returns stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(!out.status.success(), "harness {args:?} should have failed");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    pub fn spawn(&self, args: &[&str]) -> Child {
        self.cmd()
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Starts `n` copies of `harness args` at once and waits for them all.
    pub fn at_once(&self, n: usize, args: &[&str]) -> Vec<Output> {
        let children: Vec<Child> = (0..n)
            .map(|_| {
                self.cmd()
                    .args(args)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect()
    }

    /// Opens the run store with a runtime for reading.
    pub fn store(&self) -> (tokio::runtime::Runtime, rl_harness::Store) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let store = rt.block_on(rl_harness::Store::open(&self.db())).unwrap();
        (rt, store)
    }
}

/// Polls `f` every 50 ms until it returns true or `limit` passes (then panics with `what`).
pub fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every recorded metric of a run except timings and the throughput derived from them:
/// (step, key, value bits).
pub fn metrics_of(
    rt: &tokio::runtime::Runtime,
    store: &rl_harness::Store,
    run: i64,
) -> Vec<(i64, String, u64)> {
    rt.block_on(store.all_metrics(run))
        .unwrap()
        .into_iter()
        .filter(|(_, k, _, _)| !rl_core::is_wall_clock(k))
        .map(|(s, k, v, _)| (s, k, v.to_bits()))
        .collect()
}

/// A small bandit experiment.
pub const BANDIT: &str = r#"
[trainer]
algorithm = "bandit"
project_name = "test"
experiment_name = "base"
total_training_steps = 20
save_freq = 5
test_freq = 5
heartbeat_s = 0.5
seed = 7

[bandit]
batch_size = 32
"#;

/// `.venv-mlflow/bin/NAME`, the Python test tools `scripts/mlflow-env` installs (mlflow,
/// TensorBoard's reader); a clear failure when it has not been run.
pub fn venv_bin(name: &str) -> PathBuf {
    let bin = repo_root().join(".venv-mlflow/bin").join(name);
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/mlflow-env first (scripts/test does)",
        bin.display()
    );
    bin
}

/// Starts `harness ARGS`, a server that prints its address on its first line of stdout, tied to
/// the test (it dies with the test process); the process and the first word of that line that
/// starts with `http://127.0.0.1:` and ends with `suffix`.
pub fn spawn_server(env: &Env, args: &[&str], suffix: &str) -> (Tied, String) {
    let mut process = Tied::spawn(
        env.tied_cmd()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit()),
    );
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(process.child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://127.0.0.1:") && w.ends_with(suffix))
        .unwrap_or_else(|| panic!("harness {args:?} printed no address: {line:?}"))
        .to_string();
    (process, url)
}

/// The repository's root (experiments/ lives there).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Writes the tiny addition data (`data/tiny-addition`) and a tiny random Llama
/// (`models/tiny-llama`) into the env's folder, as the quickstart does but smaller.
pub fn tiny_llm(env: &Env, train: usize, test: usize) {
    let (train, test) = (train.to_string(), test.to_string());
    env.ok(&[
        "data",
        "tiny-addition",
        "data/tiny-addition",
        "--train",
        &train,
        "--test",
        &test,
        "--seed",
        "7",
    ]);
    env.ok(&["model", "init-tiny", "models/tiny-llama", "--seed", "7"]);
}

/// The harness command of `env` with one intra-op thread: data-parallel tests start several
/// processes on few cores, and libtorch's OpenMP threads spin, so more threads than free cores
/// slow every run badly.
pub fn one_thread_cmd(env: &Env) -> Command {
    let mut c = env.cmd();
    c.env("OMP_NUM_THREADS", "1");
    c
}

/// [`Env::ok`] with [`one_thread_cmd`]: asserts success, returns stdout.
pub fn one_thread_ok(env: &Env, args: &[&str]) -> String {
    let out = one_thread_cmd(env).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "harness {args:?} failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `harness train FILE OVERRIDES` on `nproc` ranks (`--nproc-per-node`, a 60 s collective
/// timeout) with one thread each, asserted to succeed; the run id it printed.
pub fn train_ranks(env: &Env, file: &str, overrides: &[&str], nproc: usize) -> i64 {
    let n = nproc.to_string();
    let mut args = vec!["train", file];
    args.extend_from_slice(overrides);
    if nproc > 1 {
        args.extend(["--nproc-per-node", &n, "--dist-timeout-s", "60"]);
    }
    let out = one_thread_ok(env, &args);
    out.lines()
        .find_map(|l| {
            l.strip_prefix("run ")?
                .strip_suffix(" finished")?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no `run N finished` in {out}"))
}

/// The tensors of a safetensors `file` by name.
pub fn safetensors(file: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .into_iter()
        .collect()
}

/// The largest `|a - b|` over every tensor; the two must hold the same names.
/// The L2 norm of `a - b` over all the tensors of `a` (each must be in `b`).
pub fn l2_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    a.iter()
        .map(|(k, x)| {
            (x - &b[k])
                .square()
                .sum(tch::Kind::Double)
                .double_value(&[])
        })
        .sum::<f64>()
        .sqrt()
}

pub fn max_abs_diff(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> f64 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "different tensors"
    );
    a.iter()
        .map(|(k, t)| (t - &b[k]).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}
