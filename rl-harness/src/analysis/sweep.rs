//! `harness sweep`: a base experiment plus a `[sweep]` table (grid or seeded random search over
//! any config keys), trials run as `harness train` child processes, `--parallel N` at once.
//!
//! The sweep id is a hash of the resolved base config and the search space, and each trial's id
//! a hash of its parameters, so re-running the same command finds the same sweep: finished
//! trials are skipped, interrupted ones resumed from their checkpoints, the rest started.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, bail};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::Row;
use tokio::runtime::Runtime;

use crate::config::{self, Override, Sources};
use crate::store::{Store, hostname, now, pid_alive};

/// Search strategies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Every combination of the `grid` lists.
    Grid,
    /// `num_trials` draws from the `random` distributions, seeded.
    Random,
}

/// A distribution of one key in a random search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Dist {
    /// Uniform in `[lo, hi]`.
    Uniform([f64; 2]),
    /// Log-uniform in `[lo, hi]`, both positive.
    LogUniform([f64; 2]),
    /// Uniform integer in `lo..=hi`.
    IntUniform([i64; 2]),
    /// One of the values.
    Choice(Vec<Value>),
}

/// The `[sweep]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepSpec {
    /// The sweep's name; default: the file's stem.
    #[serde(default)]
    pub name: Option<String>,
    /// `grid` or `random`.
    pub strategy: Strategy,
    /// The metric trials are ranked by (for `harness compare --sweep`). Default `val/test_score`.
    #[serde(default = "default_metric")]
    pub metric: String,
    /// Random search: trials to draw.
    #[serde(default)]
    pub num_trials: Option<usize>,
    /// Random search: seed.
    #[serde(default)]
    pub seed: u64,
    /// Grid: key path → values.
    #[serde(default)]
    pub grid: BTreeMap<String, Vec<Value>>,
    /// Random: key path → distribution.
    #[serde(default)]
    pub random: BTreeMap<String, Dist>,
}

fn default_metric() -> String {
    "val/test_score".into()
}

/// One trial: its id and its parameter values.
#[derive(Debug, Clone, PartialEq)]
pub struct Trial {
    /// Hash of the parameters.
    pub id: String,
    /// key path → value.
    pub params: BTreeMap<String, Value>,
}

/// A stored trial.
#[derive(Debug, Clone)]
pub struct TrialRow {
    /// Trial id.
    pub trial_id: String,
    /// Position in the sweep.
    pub idx: i64,
    /// Parameters.
    pub params: BTreeMap<String, Value>,
    /// pending, running, finished, failed.
    pub state: String,
    /// Its run, once started.
    pub run_id: Option<i64>,
    /// Cause of a failure.
    pub error: Option<String>,
}

/// FNV-1a, 64 bits: a stable hash for ids (not for security).
pub fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A trial's parameters as `key=value` words joined by `sep`, values as written on a
/// command line (`bandit.lr=0.02`, `algorithm.adv_estimator=grpo`).
pub fn params_text(params: &BTreeMap<String, Value>, sep: &str) -> String {
    params
        .iter()
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={s}"),
            v => format!("{k}={v}"),
        })
        .collect::<Vec<_>>()
        .join(sep)
}

/// The run name of a trial of sweep `name`: `<name>/<its parameters>`, so that lists and plot
/// legends tell the trials apart.
pub fn trial_name(name: &str, params: &BTreeMap<String, Value>) -> String {
    format!("{name}/{}", params_text(params, ","))
}

/// The trial id of a parameter set (canonical JSON: keys sorted).
pub fn trial_id(params: &BTreeMap<String, Value>) -> String {
    let text = serde_json::to_string(params).unwrap_or_default();
    format!("{:016x}", fnv64(text.as_bytes()))
}

/// Reads the `[sweep]` table of a sweep file.
pub fn read_spec(file: &Path) -> Result<SweepSpec> {
    let text = config::read_file(file)?;
    let mut table: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
    let sweep = table
        .remove("sweep")
        .with_context(|| format!("{} has no [sweep] table", file.display()))?;
    let spec: SweepSpec = sweep
        .try_into()
        .with_context(|| format!("the [sweep] table of {}", file.display()))?;
    match spec.strategy {
        Strategy::Grid if spec.grid.is_empty() => bail!(
            "{}: sweep.strategy = 'grid' needs a [sweep.grid] table",
            file.display()
        ),
        Strategy::Random if spec.random.is_empty() => {
            bail!(
                "{}: sweep.strategy = 'random' needs a [sweep.random] table",
                file.display()
            )
        }
        Strategy::Random if spec.num_trials.unwrap_or(0) == 0 => {
            bail!(
                "{}: sweep.num_trials must be at least 1 for a random search",
                file.display()
            )
        }
        _ => {}
    }
    for (k, vs) in &spec.grid {
        if vs.is_empty() {
            bail!("{}: sweep.grid.\"{k}\" has no values", file.display());
        }
    }
    for (k, d) in &spec.random {
        let ok = match d {
            Dist::Uniform([a, b]) => a <= b,
            Dist::LogUniform([a, b]) => *a > 0.0 && a <= b,
            Dist::IntUniform([a, b]) => a <= b,
            Dist::Choice(v) => !v.is_empty(),
        };
        if !ok {
            bail!(
                "{}: sweep.random.\"{k}\" has an empty or invalid range",
                file.display()
            );
        }
    }
    Ok(spec)
}

/// The trials of a spec, in order (duplicates of a random search dropped).
pub fn expand(spec: &SweepSpec) -> Vec<Trial> {
    let mut sets: Vec<BTreeMap<String, Value>> = Vec::new();
    match spec.strategy {
        Strategy::Grid => {
            sets.push(BTreeMap::new());
            for (k, values) in &spec.grid {
                sets = sets
                    .into_iter()
                    .flat_map(|s| {
                        values.iter().map(move |v| {
                            let mut s = s.clone();
                            s.insert(k.clone(), v.clone());
                            s
                        })
                    })
                    .collect();
            }
        }
        Strategy::Random => {
            for i in 0..spec.num_trials.unwrap_or(0) {
                let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
                rng.set_stream(i as u64);
                let s = spec
                    .random
                    .iter()
                    .map(|(k, d)| {
                        let v = match d {
                            Dist::Uniform([a, b]) => {
                                serde_json::json!(a + (b - a) * rng.random::<f64>())
                            }
                            Dist::LogUniform([a, b]) => {
                                serde_json::json!(
                                    (a.ln() + (b.ln() - a.ln()) * rng.random::<f64>()).exp()
                                )
                            }
                            Dist::IntUniform([a, b]) => {
                                serde_json::json!(rng.random_range(*a..=*b))
                            }
                            Dist::Choice(vs) => vs[rng.random_range(0..vs.len())].clone(),
                        };
                        (k.clone(), v)
                    })
                    .collect();
                sets.push(s);
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    sets.into_iter()
        .map(|params| Trial {
            id: trial_id(&params),
            params,
        })
        .filter(|t| seen.insert(t.id.clone()))
        .collect()
}

fn to_override(key: &str, v: &Value) -> Result<Override> {
    let value: Option<toml::Value> = match v {
        Value::Null => None,
        v => Some(
            serde_json::from_value(v.clone())
                .with_context(|| format!("sweep value {v} of `{key}` is not a TOML value"))?,
        ),
    };
    Ok(Override {
        key: key.into(),
        value,
    })
}

fn override_arg(key: &str, v: &Value) -> Result<String> {
    let o = to_override(key, v)?;
    Ok(format!("{key}={}", o.value_text()))
}

/// The stored trials of a sweep, in order.
pub async fn trials(store: &Store, sweep: &str) -> Result<Vec<TrialRow>> {
    let rows = sqlx::query("SELECT trial_id, idx, params, state, run_id, error FROM trials WHERE sweep_id = ? ORDER BY idx")
        .bind(sweep)
        .fetch_all(store.pool())
        .await?;
    rows.iter()
        .map(|r| {
            let params: String = r.get(2);
            Ok(TrialRow {
                trial_id: r.get(0),
                idx: r.get(1),
                params: serde_json::from_str(&params).context("a stored trial's params")?,
                state: r.get(3),
                run_id: r.get(4),
                error: r.get(5),
            })
        })
        .collect()
}

async fn set_trial(
    store: &Store,
    sweep: &str,
    trial: &str,
    state: &str,
    run: Option<i64>,
    error: Option<String>,
) -> Result<()> {
    let (sweep, trial, state) = (sweep.to_string(), trial.to_string(), state.to_string());
    store
        .write(move |c| {
            Box::pin(async move {
                sqlx::query("UPDATE trials SET state = ?, run_id = COALESCE(?, run_id), error = ? WHERE sweep_id = ? AND trial_id = ?")
                    .bind(state)
                    .bind(run)
                    .bind(error)
                    .bind(sweep)
                    .bind(trial)
                    .execute(&mut *c)
                    .await?;
                Ok(0)
            })
        })
        .await
        .map(|_| ())
}

/// This process as the owner of the trials it claims: `pid@host`.
fn me() -> String {
    format!("{}@{}", std::process::id(), hostname())
}

/// Whether the sweep process `owner` (`pid@host`) lives: known on this host, assumed elsewhere.
fn owner_alive(owner: &str) -> bool {
    match owner.split_once('@') {
        Some((pid, host)) if host == hostname() => pid.parse().is_ok_and(pid_alive),
        _ => true,
    }
}

/// Claims `trial` for this process in one transaction, so that of two sweeps of one file each
/// trial runs once. `Some(why)` when it cannot be claimed: another live sweep process holds it,
/// it finished meanwhile, or it failed and failures are not retried.
async fn claim_trial(
    store: &Store,
    sweep: &str,
    trial: &str,
    retry_failed: bool,
) -> Result<Option<String>> {
    let refused = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (sweep, trial, out) = (sweep.to_string(), trial.to_string(), refused.clone());
    store
        .write(move |c| {
            Box::pin(async move {
                let row: Option<(String, Option<String>)> = sqlx::query_as(
                    "SELECT state, owner FROM trials WHERE sweep_id = ? AND trial_id = ?",
                )
                .bind(&sweep)
                .bind(&trial)
                .fetch_optional(&mut *c)
                .await?;
                let me = me();
                let why = match row {
                    None => Some("is not recorded in the store".to_string()),
                    Some((state, owner)) => match (state.as_str(), owner) {
                        ("finished", _) => Some("finished meanwhile".into()),
                        ("failed", _) if !retry_failed => {
                            Some("failed (use --retry-failed)".into())
                        }
                        ("running", Some(o)) if o != me && owner_alive(&o) => {
                            Some(format!("is claimed by the sweep process {o}"))
                        }
                        _ => None,
                    },
                };
                if why.is_none() {
                    sqlx::query(
                        "UPDATE trials SET state = 'running', owner = ? WHERE sweep_id = ? AND trial_id = ?",
                    )
                    .bind(&me)
                    .bind(&sweep)
                    .bind(&trial)
                    .execute(&mut *c)
                    .await?;
                }
                *out.lock().unwrap_or_else(|e| e.into_inner()) = why;
                Ok(0)
            })
        })
        .await?;
    let why = refused.lock().unwrap_or_else(|e| e.into_inner()).take();
    Ok(why)
}

async fn run_of(store: &Store, sweep: &str, trial: &str) -> Result<Option<i64>> {
    Ok(sqlx::query_scalar(
        "SELECT id FROM runs WHERE sweep_id = ? AND trial_id = ? ORDER BY id DESC LIMIT 1",
    )
    .bind(sweep)
    .bind(trial)
    .fetch_optional(store.pool())
    .await?)
}

/// What the scheduler does with a trial.
enum Plan {
    Skip(&'static str),
    Start,
    Resume(i64),
}

/// Summary of a sweep invocation.
#[derive(Debug, Clone, Default)]
pub struct SweepReport {
    /// The sweep id.
    pub id: String,
    /// Trials not run by this invocation: finished before, failed (without `--retry-failed`),
    /// or claimed by another live sweep of the same file.
    pub skipped: usize,
    /// Trials started fresh.
    pub started: usize,
    /// Trials resumed from a checkpoint.
    pub resumed: usize,
    /// Trials that finished now.
    pub finished: usize,
    /// Trials that failed now.
    pub failed: usize,
}

/// What defines a sweep's base experiment, for its id: the resolved config without where its
/// results go (the store, the runs folder, exports, the tracker), with every file it reads named
/// by its canonical path. The same experiment is the same sweep however its store is named.
fn identity_of(base: &config::ExperimentConfig) -> Result<Value> {
    let mut v = serde_json::to_value(base)?;
    if let Some(t) = v.get_mut("trainer").and_then(Value::as_object_mut) {
        for key in ["db", "runs_dir", "export_dir", "tracker"] {
            t.remove(key);
        }
    }
    canonical_paths(&mut v, "");
    Ok(v)
}

/// Replaces each existing file or folder named under a path-like key (`…path`, `…files`,
/// `…file`, `…dir`, `tokenizer`) by its canonical path.
fn canonical_paths(v: &mut Value, key: &str) {
    let last = key.rsplit('.').next().unwrap_or(key);
    let path_like = ["path", "files", "file", "dir"]
        .iter()
        .any(|s| last.ends_with(s))
        || last == "tokenizer";
    match v {
        Value::Object(m) => {
            for (k, child) in m.iter_mut() {
                canonical_paths(child, &format!("{key}.{k}"));
            }
        }
        Value::Array(items) if path_like => {
            for item in items {
                canonical_paths(item, key);
            }
        }
        Value::String(s) if path_like && !s.is_empty() => {
            if let Ok(p) = std::fs::canonicalize(&*s) {
                *s = p.display().to_string();
            }
        }
        _ => {}
    }
}

/// Runs (or continues) the sweep of `file` with at most `parallel` trials at once, in the store
/// `db` when given (`harness --db`), else the one the base experiment names.
pub fn run(
    rt: &Runtime,
    file: &Path,
    parallel: usize,
    retry_failed: bool,
    db: Option<&Path>,
) -> Result<SweepReport> {
    let spec = read_spec(file)?;
    let db_override: Vec<Override> = db
        .map(|d| Override::set("trainer.db", toml::Value::String(d.display().to_string())))
        .into_iter()
        .collect();
    let base = config::load(&Sources {
        file: Some(file.to_path_buf()),
        env: true,
        overrides: db_override.clone(),
    })
    .with_context(|| format!("the base experiment of {}", file.display()))?;
    let trials = expand(&spec);
    // Every trial's config must resolve before anything starts.
    for t in &trials {
        let overrides = t
            .params
            .iter()
            .map(|(k, v)| to_override(k, v))
            .collect::<Result<Vec<_>>>()?;
        config::load(&Sources {
            file: Some(file.to_path_buf()),
            env: true,
            overrides: [db_override.clone(), overrides].concat(),
        })
        .with_context(|| format!("sweep {}: trial {:?}", file.display(), t.params))?;
    }
    let name = spec.name.clone().unwrap_or_else(|| {
        file.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "sweep".into())
    });
    let identity = serde_json::json!({"base": identity_of(&base)?, "grid": spec.grid, "random": spec.random,
        "strategy": spec.strategy, "num_trials": spec.num_trials, "seed": spec.seed});
    let id = format!(
        "{name}-{:08x}",
        fnv64(identity.to_string().as_bytes()) as u32
    );
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let devices = match crate::device::parse(&base.trainer.device)? {
        tch::Device::Cpu => usize::MAX,
        _ => (tch::Cuda::device_count() as usize).max(1),
    };
    let slots = parallel.max(1).min(cores).min(devices);
    if slots < parallel {
        note!(
            "harness: sweep {id}: running {slots} trials at once (bounded by {cores} cores / devices)"
        );
    }
    let threads_per_trial = (cores / slots).max(1);
    let store = rt.block_on(Store::open(&base.trainer.db_path()))?;
    let spec_json = serde_json::to_string(&spec)?;
    let file_s = file.display().to_string();
    let (id2, name2) = (id.clone(), name.clone());
    let trial_rows: Vec<(String, String)> = trials
        .iter()
        .map(|t| Ok((t.id.clone(), serde_json::to_string(&t.params)?)))
        .collect::<Result<_>>()?;
    rt.block_on(store.write(move |c| {
        Box::pin(async move {
            sqlx::query("INSERT OR IGNORE INTO sweeps (id, name, spec, file, created) VALUES (?, ?, ?, ?, ?)")
                .bind(&id2)
                .bind(&name2)
                .bind(&spec_json)
                .bind(&file_s)
                .bind(now())
                .execute(&mut *c)
                .await?;
            for (i, (tid, params)) in trial_rows.iter().enumerate() {
                sqlx::query(
                    "INSERT OR IGNORE INTO trials (sweep_id, trial_id, idx, params, state) VALUES (?, ?, ?, ?, 'pending')",
                )
                .bind(&id2)
                .bind(tid)
                .bind(i as i64)
                .bind(params)
                .execute(&mut *c)
                .await?;
            }
            Ok(0)
        })
    }))
    .with_context(|| format!("recording sweep {id}"))?;
    note!(
        "harness: sweep {id}: {} trials, {slots} at once",
        trials.len()
    );
    let exe = std::env::current_exe().context("finding the harness executable")?;
    let db = store.path().to_path_buf();
    let report = rt.block_on(schedule(
        &store,
        &id,
        file,
        &exe,
        &db,
        trials,
        slots,
        threads_per_trial,
        retry_failed,
    ))?;
    Ok(report)
}

async fn plan_for(store: &Store, sweep: &str, trial: &Trial, retry_failed: bool) -> Result<Plan> {
    let row = trials(store, sweep)
        .await?
        .into_iter()
        .find(|r| r.trial_id == trial.id);
    let state = row
        .as_ref()
        .map(|r| r.state.clone())
        .unwrap_or_else(|| "pending".into());
    let run = run_of(store, sweep, &trial.id).await?;
    let run_row = match run {
        Some(r) => store.run(r).await?,
        None => None,
    };
    if let Some(r) = &run_row {
        match r.effective_status() {
            "finished" => {
                set_trial(store, sweep, &trial.id, "finished", Some(r.id), None).await?;
                return Ok(Plan::Skip("finished"));
            }
            "running" => return Ok(Plan::Skip("running elsewhere")),
            _ => {}
        }
    }
    if state == "failed" && !retry_failed {
        return Ok(Plan::Skip("failed (use --retry-failed)"));
    }
    if let Some(r) = run_row
        && !store.checkpoints(r.id).await?.is_empty()
    {
        return Ok(Plan::Resume(r.id));
    }
    Ok(Plan::Start)
}

#[allow(clippy::too_many_arguments)]
async fn schedule(
    store: &Store,
    sweep: &str,
    file: &Path,
    exe: &Path,
    db: &Path,
    trials: Vec<Trial>,
    slots: usize,
    threads: usize,
    retry_failed: bool,
) -> Result<SweepReport> {
    let mut report = SweepReport {
        id: sweep.to_string(),
        ..Default::default()
    };
    let mut queue = Vec::new();
    for t in trials {
        match plan_for(store, sweep, &t, retry_failed).await? {
            Plan::Skip(why) => {
                note!("harness: sweep {sweep}: trial {} {why}, skipped", t.id);
                report.skipped += 1;
            }
            _ => queue.push(t),
        }
    }
    queue.reverse();
    let mut running = tokio::task::JoinSet::new();
    loop {
        while running.len() < slots
            && let Some(t) = queue.pop()
        {
            // Claimed first, then planned again: another sweep of the same file may have
            // started, finished or left it since the plan above.
            let claimed = match claim_trial(store, sweep, &t.id, retry_failed).await? {
                Some(why) => Err(why),
                None => match plan_for(store, sweep, &t, retry_failed).await? {
                    Plan::Skip(why) => Err(why.to_string()),
                    plan => Ok(plan),
                },
            };
            let plan = match claimed {
                Ok(plan) => plan,
                Err(why) => {
                    note!("harness: sweep {sweep}: trial {} {why}, skipped", t.id);
                    report.skipped += 1;
                    continue;
                }
            };
            let mut cmd = tokio::process::Command::new(exe);
            cmd.arg("--db").arg(db);
            let resume_id = match plan {
                Plan::Resume(r) => {
                    report.resumed += 1;
                    cmd.arg("resume").arg(r.to_string());
                    Some(r)
                }
                _ => {
                    report.started += 1;
                    cmd.arg("train").arg(file);
                    for (k, v) in &t.params {
                        cmd.arg(override_arg(k, v)?);
                    }
                    let name = sweep.rsplit_once('-').map_or(sweep, |(n, _)| n);
                    cmd.arg(format!(
                        "trainer.experiment_name='{}'",
                        trial_name(name, &t.params).replace('\'', "")
                    ));
                    cmd.arg("--sweep-id")
                        .arg(sweep)
                        .arg("--trial-id")
                        .arg(&t.id);
                    None
                }
            };
            cmd.env("OMP_NUM_THREADS", threads.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .kill_on_drop(false);
            set_trial(store, sweep, &t.id, "running", resume_id, None).await?;
            note!(
                "harness: sweep {sweep}: trial {} {} {}",
                t.id,
                if resume_id.is_some() {
                    "resumes"
                } else {
                    "starts"
                },
                params_text(&t.params, " ")
            );
            let child = cmd
                .spawn()
                .with_context(|| format!("starting {}", exe.display()))?;
            running.spawn(async move {
                let out = child.wait_with_output().await;
                (t, out)
            });
        }
        let Some(joined) = running.join_next().await else {
            break;
        };
        let (t, out) = joined.context("a trial's waiter panicked")?;
        let run = run_of(store, sweep, &t.id).await?;
        match out {
            Ok(o) if o.status.success() => {
                report.finished += 1;
                set_trial(store, sweep, &t.id, "finished", run, None).await?;
                note!(
                    "harness: sweep {sweep}: trial {} finished (run {})",
                    t.id,
                    run.unwrap_or(-1)
                );
            }
            Ok(o) => {
                report.failed += 1;
                let stderr = String::from_utf8_lossy(&o.stderr);
                let cause = stderr
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("no output")
                    .to_string();
                store.event(
                    run,
                    "trial_failed",
                    format!("sweep {sweep} trial {}: {cause}", t.id),
                )?;
                set_trial(store, sweep, &t.id, "failed", run, Some(cause.clone())).await?;
                note!("harness: sweep {sweep}: trial {} failed: {cause}", t.id);
            }
            Err(e) => {
                report.failed += 1;
                set_trial(store, sweep, &t.id, "failed", run, Some(e.to_string())).await?;
            }
        }
    }
    store.flush().await?;
    Ok(report)
}

/// A stored sweep.
#[derive(Debug, Clone)]
pub struct SweepRow {
    /// Its id.
    pub id: String,
    /// Its `[sweep] name`.
    pub name: String,
    /// The metric it ranks its trials by (`[sweep] metric`).
    pub metric: Option<String>,
    /// How many trials it has.
    pub trials: i64,
}

/// Every stored sweep, oldest first.
pub async fn sweeps(store: &Store) -> Result<Vec<SweepRow>> {
    let rows = sqlx::query(
        "SELECT s.id, s.name, s.spec, (SELECT COUNT(*) FROM trials t WHERE t.sweep_id = s.id) \
         FROM sweeps s ORDER BY s.created, s.id",
    )
    .fetch_all(store.pool())
    .await
    .context("reading the sweeps")?;
    Ok(rows
        .iter()
        .map(|r| {
            let spec: String = r.get(2);
            SweepRow {
                id: r.get(0),
                name: r.get(1),
                metric: serde_json::from_str::<Value>(&spec)
                    .ok()
                    .and_then(|v| v.get("metric")?.as_str().map(String::from)),
                trials: r.get(3),
            }
        })
        .collect())
}

/// The sweep file path a sweep was created from.
pub async fn sweep_file(store: &Store, sweep: &str) -> Result<Option<PathBuf>> {
    let f: Option<String> = sqlx::query_scalar("SELECT file FROM sweeps WHERE id = ?")
        .bind(sweep)
        .fetch_optional(store.pool())
        .await?;
    Ok(f.map(PathBuf::from))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_identity_leaves_out_where_results_go_and_names_files_canonically() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("train.parquet");
        std::fs::write(&data, b"rows").unwrap();
        let mut a = config::ExperimentConfig::default();
        a.data.train_files = vec![data.clone()];
        let mut b = a.clone();
        b.data.train_files = vec![dir.path().join("./sub/../train.parquet")];
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        b.trainer.db = Some(dir.path().join("elsewhere.db"));
        b.trainer.runs_dir = dir.path().join("other-runs");
        assert_eq!(identity_of(&a).unwrap(), identity_of(&b).unwrap());
        b.data.train_files = vec![dir.path().join("missing.parquet")];
        assert_ne!(identity_of(&a).unwrap(), identity_of(&b).unwrap());
        let mut c = a.clone();
        c.trainer.seed += 1;
        assert_ne!(
            identity_of(&a).unwrap(),
            identity_of(&c).unwrap(),
            "the seed is the experiment"
        );
    }

    #[test]
    fn grid_is_the_cartesian_product_with_stable_ids() {
        let spec: SweepSpec =
            toml::from_str("strategy = 'grid'\n[grid]\n'a.x' = [1, 2]\n'b' = ['p', 'q', 'r']\n")
                .unwrap();
        let trials = expand(&spec);
        assert_eq!(trials.len(), 6);
        assert_eq!(trials[0].params["a.x"], json!(1));
        assert_eq!(trials, expand(&spec));
        let ids: std::collections::HashSet<_> = trials.iter().map(|t| &t.id).collect();
        assert_eq!(ids.len(), 6);
    }

    #[test]
    fn random_is_seeded_and_within_range() {
        let spec: SweepSpec = toml::from_str(
            "strategy = 'random'\nnum_trials = 5\nseed = 3\n[random]\n'lr' = { log_uniform = [0.01, 0.1] }\n'n' = { choice = [1, 2] }\n",
        )
        .unwrap();
        let a = expand(&spec);
        assert_eq!(a, expand(&spec));
        assert!(!a.is_empty() && a.len() <= 5);
        for t in &a {
            let lr = t.params["lr"].as_f64().unwrap();
            assert!((0.01..=0.1).contains(&lr), "{lr}");
        }
        let other = SweepSpec { seed: 4, ..spec };
        assert_ne!(expand(&other)[0], a[0]);
    }
}
