//! Python reward functions run unchanged: a pool of persistent worker processes of the user's
//! own interpreter (`reward.python`), each loading verl's `custom_reward_function` file once and
//! answering batches of rows over JSON lines (the worker is `worker.py`, beside this file).
//!
//! - Every `compute_score` call has `reward.timeout_s`: a worker whose call runs longer is killed
//!   (SIGKILL, so a scorer stuck in C code stops too) and restarted, and the row counts as failed.
//! - A worker that dies mid-batch (killed, out of memory, a segfault in an extension) is
//!   restarted and the batch goes on from the row it was scoring; a row whose worker dies twice
//!   counts as failed.
//! - A failed row (an exception, with its traceback; a timeout; a return that is not a number
//!   or a dict with a numeric `score`) is an error naming the row, its data source and the file
//!   with `reward.on_error = "raise"`, or scores 0 with the reason in its extras with `"zero"`.
//! - A file or function that cannot be loaded, or an interpreter that cannot start, is an error
//!   when the pool starts, before any row is scored.
//!
//! The kernel kills the workers when the pool's spawning thread ends (Linux's parent-death
//! signal, set by the worker itself), so a killed trainer leaves none behind.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::{RewardFn, RewardOutput, ScoreRow};
use crate::error::{Error, Result};

/// The worker program, passed to the interpreter with `-c`.
const WORKER: &str = include_str!("worker.py");

/// The extra a row that failed under `on_error = "zero"` carries: why it failed.
pub const FAILED: &str = "reward_error";

/// What a failed row (exception, timeout, bad return, dead worker) becomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// The step fails with an error naming the row, its data source and the traceback.
    #[default]
    Raise,
    /// The row scores 0, its extras say why (`reward_error`), and the step goes on.
    Zero,
}

/// How a pool runs: the interpreter, the number of workers, the per-call timeout and what a
/// failed row becomes.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSettings {
    /// The interpreter (`python3`, `/path/to/venv/bin/python`).
    pub python: String,
    /// Worker processes, at least 1.
    pub workers: usize,
    /// Seconds one `compute_score` call may take.
    pub timeout_s: f64,
    /// What a failed row becomes.
    pub on_error: OnError,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            python: "python3".into(),
            workers: 4,
            timeout_s: 30.0,
            on_error: OnError::Raise,
        }
    }
}

/// One Python function: `name` in `file`, called with `kwargs` on top of verl's four arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct PythonFunction {
    /// The `.py` file.
    pub file: PathBuf,
    /// The function's name in it.
    pub name: String,
    /// Extra keyword arguments (verl's `custom_reward_function.reward_kwargs`).
    pub kwargs: Map<String, Value>,
    /// The file's text when it is compiled into this crate (the bridge's own scorers), else
    /// `None` and the worker reads `file`.
    pub source: Option<&'static str>,
}

impl PythonFunction {
    /// `name` in the user's `file`.
    pub fn file(
        file: impl Into<PathBuf>,
        name: impl Into<String>,
        kwargs: Map<String, Value>,
    ) -> Self {
        Self {
            file: file.into(),
            name: name.into(),
            kwargs,
            source: None,
        }
    }
}

impl PythonFunction {
    fn describe(&self) -> String {
        format!("reward function `{}` in {}", self.name, self.file.display())
    }
}

/// What one call returned.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Score(f64),
    Dict(Map<String, Value>),
    /// Not a score: why.
    Failed(String),
}

/// A started worker: its process, its stdin, and the lines of its protocol stdout.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl Worker {
    fn kill(mut self) -> String {
        let _ = self.child.kill();
        match self.child.wait() {
            Ok(status) => status.to_string(),
            Err(e) => format!("unknown status ({e})"),
        }
    }

    /// The last lines the worker wrote to stderr, for an error message.
    fn stderr_tail(&self) -> String {
        // the reader thread may still be draining the pipe of a process that just exited
        thread::sleep(Duration::from_millis(50));
        let tail = self.stderr.lock().map(|t| t.clone()).unwrap_or_default();
        if tail.is_empty() {
            String::new()
        } else {
            format!("; its stderr ended with:\n{}", Vec::from(tail).join("\n"))
        }
    }
}

type SpawnRequest = (Command, Sender<std::io::Result<Child>>);

/// A pool of persistent Python workers running one function.
pub struct PythonPool {
    function: PythonFunction,
    settings: PoolSettings,
    slots: Vec<Mutex<Option<Worker>>>,
    pids: Mutex<Vec<Option<u32>>>,
    /// Every process is started by this one long-lived thread: the workers' parent-death signal
    /// fires when the thread that forked them ends.
    spawner: Mutex<Sender<SpawnRequest>>,
    restarts: AtomicU64,
}

impl std::fmt::Debug for PythonPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PythonPool")
            .field("function", &self.function)
            .field("settings", &self.settings)
            .finish()
    }
}

impl PythonPool {
    /// Starts `settings.workers` workers of `function` and waits until each has loaded it.
    pub fn start(function: PythonFunction, settings: PoolSettings) -> Result<Self> {
        if settings.workers == 0 {
            return Err(Error::Config {
                key: "reward.workers".into(),
                message: "must be at least 1".into(),
            });
        }
        if !(settings.timeout_s > 0.0 && settings.timeout_s.is_finite()) {
            return Err(Error::Config {
                key: "reward.timeout_s".into(),
                message: format!(
                    "must be a positive number of seconds, got {}",
                    settings.timeout_s
                ),
            });
        }
        if function.source.is_none() && !function.file.is_file() {
            return Err(Error::PythonReward {
                what: function.describe(),
                message: "no such file".into(),
            });
        }
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        thread::Builder::new()
            .name("reward-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .map_err(|e| Error::PythonReward {
                what: function.describe(),
                message: format!("cannot start the spawning thread: {e}"),
            })?;
        let pool = Self {
            slots: (0..settings.workers).map(|_| Mutex::new(None)).collect(),
            pids: Mutex::new(vec![None; settings.workers]),
            function,
            settings,
            spawner: Mutex::new(tx),
            restarts: AtomicU64::new(0),
        };
        // start them all at once: each imports the user's file (sympy takes a second or two)
        let started: Vec<Result<Worker>> = thread::scope(|s| {
            let p = &pool;
            let handles: Vec<_> = (0..pool.slots.len())
                .map(|i| s.spawn(move || p.spawn_worker(i)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::PythonReward {
                            what: pool.function.describe(),
                            message: "a worker start panicked".into(),
                        })
                    })
                })
                .collect()
        });
        for (slot, w) in pool.slots.iter().zip(started) {
            *slot.lock().map_err(|_| pool.poisoned())? = Some(w?);
        }
        Ok(pool)
    }

    /// The settings the pool runs with.
    pub fn settings(&self) -> &PoolSettings {
        &self.settings
    }

    /// How many workers have been restarted (after a timeout or a death) since the start.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    /// The process ids of the running workers.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.pids
            .lock()
            .map(|p| p.iter().flatten().copied().collect())
            .unwrap_or_default()
    }

    fn poisoned(&self) -> Error {
        Error::PythonReward {
            what: self.function.describe(),
            message: "a worker slot was poisoned by a panic".into(),
        }
    }

    fn spawn_worker(&self, slot: usize) -> Result<Worker> {
        let what = self.function.describe();
        let kwargs = Value::Object(self.function.kwargs.clone()).to_string();
        let mut cmd = Command::new(&self.settings.python);
        cmd.arg("-c")
            .arg(WORKER)
            .arg(&self.function.file)
            .arg(&self.function.name)
            .arg(kwargs)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("PYTHONUNBUFFERED", "1");
        if let Some(source) = self.function.source {
            cmd.env("RL_REWARD_SOURCE", source);
        }
        let (reply_tx, reply_rx) = mpsc::channel();
        self.spawner
            .lock()
            .map_err(|_| self.poisoned())?
            .send((cmd, reply_tx))
            .map_err(|_| Error::PythonReward {
                what: what.clone(),
                message: "the spawning thread is gone".into(),
            })?;
        let mut child = reply_rx
            .recv()
            .map_err(|_| Error::PythonReward {
                what: what.clone(),
                message: "the spawning thread is gone".into(),
            })?
            .map_err(|e| Error::Config {
                key: "reward.python".into(),
                message: format!("cannot start `{}`: {e}", self.settings.python),
            })?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::PythonReward {
                what,
                message: "the worker's pipes were not set up".into(),
            });
        };
        let (line_tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let tail_w = tail.clone();
        let pid = child.id();
        thread::spawn(move || {
            let mut err = std::io::stderr();
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                // the user's own prints and warnings, as verl shows them
                let _ = writeln!(err, "[reward worker {pid}] {line}");
                if let Ok(mut t) = tail_w.lock() {
                    if t.len() == 20 {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            }
        });
        let worker = Worker {
            child,
            stdin,
            lines,
            stderr: tail,
        };
        // loading the file may import heavy packages or read data: a generous start budget
        let start_s = (self.settings.timeout_s * 4.0).max(120.0);
        let first = worker.lines.recv_timeout(Duration::from_secs_f64(start_s));
        let fail = |worker: Worker, message: String| {
            let tail = worker.stderr_tail();
            let status = worker.kill();
            Err(Error::PythonReward {
                what: what.clone(),
                message: format!(
                    "the worker (`{}`) {message} (exit: {status}){tail}",
                    self.settings.python
                ),
            })
        };
        let line = match first {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                return fail(worker, format!("did not load the file within {start_s} s"));
            }
            Err(RecvTimeoutError::Disconnected) => {
                return fail(
                    worker,
                    "exited before it was ready (is reward.python a Python 3 interpreter?)".into(),
                );
            }
        };
        match serde_json::from_str::<Value>(&line) {
            Ok(v) if v.get("ready").is_some() => {
                if let Ok(mut p) = self.pids.lock() {
                    p[slot] = Some(pid);
                }
                Ok(worker)
            }
            Ok(v) if v.get("fatal").is_some() => {
                let _ = worker.kill();
                Err(Error::PythonReward {
                    what,
                    message: format!(
                        "cannot be loaded:\n{}",
                        v["fatal"].as_str().unwrap_or_default().trim_end()
                    ),
                })
            }
            _ => fail(worker, format!("answered {line:?} instead of starting")),
        }
    }

    /// Calls the function on every row, spread over the workers; one outcome per row, in order.
    fn call(&self, rows: &[ScoreRow<'_>]) -> Result<Vec<Outcome>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let requests: Vec<Value> = rows
            .iter()
            .map(|r| {
                json!({
                    "data_source": r.data_source,
                    "solution_str": r.response,
                    "ground_truth": r.ground_truth,
                    "extra_info": r.extra_info,
                })
            })
            .collect();
        // small chunks balance the load (scorers differ in cost) at a line per chunk
        let chunk = rows.len().div_ceil(self.slots.len() * 4).max(1);
        let chunks: Vec<(usize, usize)> = (0..rows.len())
            .step_by(chunk)
            .map(|s| (s, (s + chunk).min(rows.len())))
            .collect();
        let next = AtomicUsize::new(0);
        let results: Vec<Result<Vec<(usize, Outcome)>>> = thread::scope(|s| {
            let handles: Vec<_> = (0..self.slots.len())
                .map(|slot| {
                    let (chunks, next, requests) = (&chunks, &next, &requests);
                    s.spawn(move || {
                        let mut out = Vec::new();
                        while let Some(&(a, b)) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                            self.run_chunk(slot, requests, a, b, &mut out)?;
                        }
                        Ok(out)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(self.poisoned())))
                .collect()
        });
        let mut outcomes = vec![None; rows.len()];
        for r in results {
            for (i, o) in r? {
                outcomes[i] = Some(o);
            }
        }
        outcomes
            .into_iter()
            .enumerate()
            .map(|(i, o)| {
                o.ok_or_else(|| Error::PythonReward {
                    what: self.function.describe(),
                    message: format!("row {i} was never answered"),
                })
            })
            .collect()
    }

    /// Scores rows `a..b` on the worker of `slot`, restarting it after a timeout or a death.
    fn run_chunk(
        &self,
        slot: usize,
        requests: &[Value],
        a: usize,
        b: usize,
        out: &mut Vec<(usize, Outcome)>,
    ) -> Result<()> {
        let mut guard = self.slots[slot].lock().map_err(|_| self.poisoned())?;
        let timeout = Duration::from_secs_f64(self.settings.timeout_s);
        let mut next = a;
        let mut died_at: Option<usize> = None;
        while next < b {
            let worker = match guard.as_mut() {
                Some(w) => w,
                None => {
                    self.restarts.fetch_add(1, Ordering::Relaxed);
                    guard.insert(self.spawn_worker(slot)?)
                }
            };
            let line = json!({ "items": &requests[next..b] }).to_string() + "\n";
            // a dead worker's pipe refuses the write; its death is then seen on the read
            let _ = worker
                .stdin
                .write_all(line.as_bytes())
                .and_then(|()| worker.stdin.flush());
            while next < b {
                match worker.lines.recv_timeout(timeout) {
                    Ok(line) => {
                        out.push((next, self.parse(&line)?));
                        next += 1;
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        if let Some(w) = guard.take() {
                            w.kill();
                        }
                        out.push((
                            next,
                            Outcome::Failed(format!(
                                "timed out after reward.timeout_s = {} s (the worker was killed and restarted)",
                                self.settings.timeout_s
                            )),
                        ));
                        next += 1;
                        break;
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        let status = guard.take().map(Worker::kill).unwrap_or_default();
                        if died_at == Some(next) {
                            // twice on the same row: the row kills it
                            out.push((
                                next,
                                Outcome::Failed(format!(
                                    "the worker died while scoring it, twice (exit: {status})"
                                )),
                            ));
                            next += 1;
                        } else {
                            died_at = Some(next);
                        }
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    fn parse(&self, line: &str) -> Result<Outcome> {
        let v: Value = serde_json::from_str(line).map_err(|e| Error::PythonReward {
            what: self.function.describe(),
            message: format!("the worker answered {line:?}, not JSON ({e})"),
        })?;
        Ok(if let Some(s) = v.get("score") {
            match s.as_f64() {
                Some(x) => Outcome::Score(x),
                None => Outcome::Failed(format!("returned {s}, not a finite number")),
            }
        } else if let Some(Value::Object(d)) = v.get("dict") {
            match d.get("score") {
                Some(s) if s.as_f64().is_some() => Outcome::Dict(d.clone()),
                Some(s) => Outcome::Failed(format!(
                    "returned a dict whose `score` is {s}, not a finite number"
                )),
                None => Outcome::Failed(format!(
                    "returned a dict without a `score` key (keys: {})",
                    d.keys().cloned().collect::<Vec<_>>().join(", ")
                )),
            }
        } else if let Some(b) = v.get("bad").and_then(Value::as_str) {
            Outcome::Failed(format!(
                "returned {b}, not a number or a dict with a `score`"
            ))
        } else if let Some(tb) = v.get("error").and_then(Value::as_str) {
            Outcome::Failed(format!("raised:\n{}", tb.trim_end()))
        } else {
            return Err(Error::PythonReward {
                what: self.function.describe(),
                message: format!("the worker answered {line:?}"),
            });
        })
    }

    /// Scores `rows`: one output per row, failed rows as `on_error` says.
    pub fn score_rows(&self, rows: &[ScoreRow<'_>]) -> Result<Vec<RewardOutput>> {
        let outcomes = self.call(rows)?;
        rows.iter()
            .zip(outcomes)
            .enumerate()
            .map(|(i, (row, o))| match o {
                Outcome::Score(x) => Ok(RewardOutput::new(x)),
                Outcome::Dict(mut d) => {
                    let score = d.remove("score").and_then(|s| s.as_f64()).unwrap_or(0.0);
                    Ok(RewardOutput {
                        score,
                        extra: d.into_iter().collect(),
                    })
                }
                Outcome::Failed(why) => match self.settings.on_error {
                    OnError::Raise => Err(Error::PythonReward {
                        what: self.function.describe(),
                        message: format!(
                            "row {i} (data_source `{}`) {why}\n(reward.on_error = \"zero\" scores such rows 0 and counts them instead)",
                            row.data_source
                        ),
                    }),
                    OnError::Zero => Ok(RewardOutput::new(0.0).with(FAILED, why)),
                },
            })
            .collect()
    }
}

impl Drop for PythonPool {
    fn drop(&mut self) {
        for slot in &self.slots {
            let w = match slot.lock() {
                Ok(mut g) => g.take(),
                Err(p) => p.into_inner().take(),
            };
            if let Some(mut w) = w {
                // closing stdin ends a worker between calls; kill the one that is mid-call
                drop(w.stdin);
                let _ = w.child.kill();
                let _ = w.child.wait();
            }
        }
    }
}

impl RewardFn for PythonPool {
    fn score(
        &self,
        response: &str,
        ground_truth: &Value,
        extra_info: &Value,
    ) -> Result<RewardOutput> {
        let row = ScoreRow::of_response(response, ground_truth, extra_info);
        self.score_rows(std::slice::from_ref(&row))?
            .pop()
            .ok_or_else(|| self.poisoned())
    }

    fn score_batch(&self, rows: &[ScoreRow<'_>]) -> Result<Vec<RewardOutput>> {
        self.score_rows(rows)
    }
}

/// A pool started on first use: the scorers of the Python bridge (geo3k, math-verify,
/// prime_math) that the default table names, so that no run whose data never names them starts
/// Python.
pub struct LazyPool {
    function: PythonFunction,
    settings: PoolSettings,
    cell: std::sync::OnceLock<std::result::Result<PythonPool, String>>,
    /// Shown when the pool cannot start: which package the scorer needs.
    hint: String,
}

impl LazyPool {
    /// A pool of `function` under `settings`, started by the first batch it scores.
    pub fn new(function: PythonFunction, settings: PoolSettings, hint: impl Into<String>) -> Self {
        Self {
            function,
            settings,
            cell: std::sync::OnceLock::new(),
            hint: hint.into(),
        }
    }

    fn pool(&self) -> Result<&PythonPool> {
        self.cell
            .get_or_init(|| {
                PythonPool::start(self.function.clone(), self.settings.clone())
                    .map_err(|e| format!("{e}\n{}", self.hint))
            })
            .as_ref()
            .map_err(|message| Error::PythonReward {
                what: self.function.describe(),
                message: message.clone(),
            })
    }
}

impl RewardFn for LazyPool {
    fn score(
        &self,
        response: &str,
        ground_truth: &Value,
        extra_info: &Value,
    ) -> Result<RewardOutput> {
        self.pool()?.score(response, ground_truth, extra_info)
    }

    fn score_batch(&self, rows: &[ScoreRow<'_>]) -> Result<Vec<RewardOutput>> {
        self.pool()?.score_rows(rows)
    }
}

/// The bridge's own scorers, Python files compiled into this crate (`bridge/` beside this file)
/// and handed to the workers as source: `name` in `bridge/<file>`.
pub fn bridge_function(
    file: &str,
    name: &str,
    kwargs: Map<String, Value>,
) -> Option<PythonFunction> {
    BRIDGE
        .iter()
        .find(|(f, _)| *f == file)
        .map(|(f, source)| PythonFunction {
            file: PathBuf::from(format!("rl-data/src/reward/bridge/{f}")),
            name: name.into(),
            kwargs,
            source: Some(source),
        })
}

const BRIDGE: &[(&str, &str)] = &[
    ("geo3k.py", include_str!("bridge/geo3k.py")),
    ("math_verify.py", include_str!("bridge/math_verify.py")),
    ("prime_math.py", include_str!("bridge/prime_math.py")),
];
