//! `harness train` and `harness resume`: the training loop the harness owns (validation,
//! metrics, checkpoints, heartbeat, signals, status) around a [`Trainer`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use rl_core::StepMetrics;
use rl_core::device_memory;
use rl_core::dist::{self, SharedCollective};
use rl_workers::roles::ProgressHook;
use tokio::runtime::Runtime;

use crate::config::{self, ExperimentConfig, Override, TrainerKind};
use crate::integrations::tracker;
use crate::logging;
use crate::run::checkpoint;
use crate::run::compose::{self, Built};
use crate::run::rank::{self, Membership, Rank};
use crate::store::{self, Store, now};

/// How a drive ended.
enum Outcome {
    Finished,
    Killed,
}

/// The console's progress bars: training steps, and the decode steps of the generation under
/// way. They redraw in place with ANSI cursor codes, so they are hidden wherever the logs are
/// plain (`logging::stderr_ansi`: stderr is not a terminal, or `NO_COLOR` is set).
pub struct Bars {
    _multi: MultiProgress,
    step: ProgressBar,
    generation: ProgressBar,
}

impl Bars {
    /// Both bars, empty; hidden unless `logging::stderr_ansi`.
    pub fn new() -> Self {
        let multi = if logging::stderr_ansi() {
            MultiProgress::new()
        } else {
            MultiProgress::with_draw_target(ProgressDrawTarget::hidden())
        };
        let step = multi.add(ProgressBar::new(0));
        step.set_style(
            ProgressStyle::with_template(
                "{spinner} step {pos}/{len} [{bar:30}] {elapsed} eta {eta} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let generation = multi.add(ProgressBar::new(0));
        generation.set_style(
            ProgressStyle::with_template(
                "  generating {pos}/{len} tokens [{bar:30}] eta {eta} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Bars {
            _multi: multi,
            step,
            generation,
        }
    }

    /// Bars that never draw (the ranks other than 0 of a data-parallel run).
    pub fn hidden() -> Self {
        let bars = Bars::new();
        bars._multi.set_draw_target(ProgressDrawTarget::hidden());
        bars
    }

    /// A rollout progress hook that drives the generation bar.
    pub fn generation_hook(&self) -> ProgressHook {
        let bar = self.generation.clone();
        Arc::new(move |p| {
            if p.step == 1 {
                bar.reset();
                bar.set_length(p.max_steps.max(0) as u64);
            }
            bar.set_position(p.step.max(0) as u64);
            bar.set_message(format!(
                "{}/{} rows done, {} tokens",
                p.finished_rows, p.total_rows, p.generated_tokens
            ));
        })
    }

    /// Prints `line` on stderr, above the bars when they draw.
    fn println(&self, line: &str) {
        if self.step.is_hidden() {
            note!("{line}");
        } else {
            self._multi.println(line).ok();
        }
    }

    fn finish(&self) {
        self.generation.finish_and_clear();
        self.step.finish_and_clear();
    }
}

impl Default for Bars {
    fn default() -> Self {
        Bars::new()
    }
}

impl std::fmt::Debug for Bars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bars").finish_non_exhaustive()
    }
}

/// Builds the trainer the config selects; generations report to `progress`.
pub fn build_trainer(cfg: &ExperimentConfig, progress: Option<ProgressHook>) -> Result<Built> {
    build_trainer_in(cfg, progress, None)
}

/// [`build_trainer`] as one rank of the data-parallel `group`.
pub fn build_trainer_in(
    cfg: &ExperimentConfig,
    progress: Option<ProgressHook>,
    group: Option<&SharedCollective>,
) -> Result<Built> {
    if config::eval_only(cfg) {
        // the trainers plan at least one step; the drive takes none
        return build_trainer_in(&config::as_planned(cfg), progress, group);
    }
    let device = match (group, cfg.trainer.device.as_str()) {
        // torch DDP's convention: each rank of a host on its own GPU, cuda:LOCAL_RANK
        (Some(_), "cuda") => {
            let local = std::env::var("LOCAL_RANK").unwrap_or_else(|_| "0".into());
            let local: usize = local
                .trim()
                .parse()
                .with_context(|| format!("LOCAL_RANK={local:?} is not a rank"))?;
            crate::device::open(&format!("cuda:{local}"))
                .context("trainer.device = \"cuda\" on a data-parallel rank is cuda:LOCAL_RANK")?
        }
        _ => crate::device::open(&cfg.trainer.device)?,
    };
    rl_workers::gemm::set_cpu_gemm(cfg.trainer.cpu_gemm);
    match cfg.trainer.algorithm {
        TrainerKind::Bandit if group.is_some() => {
            bail!("{}", TrainerKind::Bandit.not_data_parallel())
        }
        TrainerKind::Bandit => {
            let total = cfg
                .trainer
                .total_training_steps
                .unwrap_or(cfg.trainer.total_epochs * cfg.bandit.steps_per_epoch);
            Ok(Built {
                trainer: Box::new(crate::bandit::BanditTrainer::new(
                    &cfg.bandit,
                    cfg.trainer.seed,
                    total,
                    cfg.algorithm.kl_ctrl.kl_coef,
                    device,
                )?),
                model: None,
                source_dir: None,
                device,
            })
        }
        _ => compose::build_with_group(cfg, device, progress, group),
    }
}

/// After a finished run: the trained model (the policy, or the reward model of a reward_model
/// run) as a Hugging Face folder in `<run dir>/model` and, when set, in `trainer.export_dir`.
/// Rank 0's part: with the weights sharded (ZeRO stage 3) every other rank calls
/// [`join_export`] meanwhile.
fn export(built: &Built, run_dir: &Path, cfg: &ExperimentConfig) -> Result<()> {
    let Some(model) = &built.model else {
        return Ok(());
    };
    model.gather_whole()?;
    let written = (|| -> Result<()> {
        let Some(src) = &built.source_dir else {
            return Ok(());
        };
        let mut outs = vec![run_dir.join("model")];
        outs.extend(cfg.trainer.export_dir.clone());
        for out in outs {
            compose::export_model(model, src, &out)?;
            tracing::info!("{} exported to {}", model.name(), out.display());
            note!(
                "harness: trained {} written to {}",
                model.name(),
                out.display()
            );
        }
        Ok(())
    })();
    model.release_whole()?;
    written
}

/// A rank other than 0 at the end of a finished run: takes part in gathering weights sharded
/// by ZeRO stage 3 for rank 0's [`export`] (a no-op when they are whole).
fn join_export(built: &Built, cfg: &ExperimentConfig) -> Result<()> {
    match &built.model {
        Some(model) if !config::eval_only(cfg) => {
            model.gather_whole()?;
            model.release_whole()
        }
        _ => Ok(()),
    }
}

fn git_info() -> (Option<String>, Option<bool>) {
    let out = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = out(&["rev-parse", "HEAD"]);
    let dirty = commit
        .as_ref()
        .and_then(|_| out(&["status", "--porcelain", "--untracked-files=no"]))
        .map(|s| !s.is_empty());
    (commit, dirty)
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Starts a new run: records it, makes its directory, trains it to the end.
/// Returns the run id.
pub fn train(rt: &Runtime, cfg: ExperimentConfig, member: Membership) -> Result<i64> {
    let store = rt.block_on(Store::open(&cfg.trainer.db_path()))?;
    let (run_id, run_dir) = create_run(rt, &store, &cfg, member)?;
    train_created(rt, &store, run_id, &run_dir, &cfg, None)
}

/// Records a new run (status `running`, this process's pid), makes its directory and writes
/// its `config.toml`; returns its id and directory. The launcher calls it before it starts the
/// ranks, so that it can mark the run failed whichever rank dies.
pub fn create_run(
    rt: &Runtime,
    store: &Store,
    cfg: &ExperimentConfig,
    member: Membership,
) -> Result<(i64, PathBuf)> {
    let config_json = config::to_json(cfg)?;
    let (commit, dirty) = git_info();
    let name = cfg.trainer.experiment_name.clone();
    let project = cfg.trainer.project_name.clone();
    // Absolute, so that `resume`, `show` and sweeps work from any working directory.
    let runs_dir = std::path::absolute(&cfg.trainer.runs_dir).with_context(|| {
        format!(
            "resolving trainer.runs_dir {}",
            cfg.trainer.runs_dir.display()
        )
    })?;
    let seed = cfg.trainer.seed as i64;
    let heartbeat_s = cfg.trainer.heartbeat_s;
    let tracker_on = cfg.trainer.tracker.kind != config::TrackerKind::None;
    let tracked = cfg.clone();
    let run_id = rt.block_on(store.write(move |c| {
        Box::pin(async move {
            let t = now();
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO runs (name, project, status, config, git_commit, git_dirty, host, pid, \
                 seed, run_dir, created, started, heartbeat, heartbeat_s, sweep_id, trial_id) \
                 VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, '', ?, ?, ?, ?, ?, ?) RETURNING id",
            )
            .bind(&name)
            .bind(&project)
            .bind(&config_json)
            .bind(commit)
            .bind(dirty.map(i64::from))
            .bind(store::hostname())
            .bind(i64::from(std::process::id()))
            .bind(seed)
            .bind(t)
            .bind(t)
            .bind(t)
            .bind(heartbeat_s)
            .bind(member.sweep_id)
            .bind(member.trial_id)
            .fetch_one(&mut *c)
            .await?;
            let dir = new_run_dir(&runs_dir, id, &name)?;
            sqlx::query("UPDATE runs SET run_dir = ? WHERE id = ?")
                .bind(dir.display().to_string())
                .bind(id)
                .execute(&mut *c)
                .await?;
            if tracker_on {
                tracker::enqueue_start(c, id, &tracked).await?;
            }
            Ok(id)
        })
    }))
    .context("recording the new run")?;
    let run_dir = run_dir_of(rt, store, run_id)?;
    std::fs::create_dir_all(run_dir.join("checkpoints"))
        .with_context(|| format!("creating run directory {}", run_dir.display()))?;
    std::fs::write(run_dir.join("config.toml"), config::to_toml(cfg)?)
        .with_context(|| format!("writing {}/config.toml", run_dir.display()))?;
    Ok((run_id, run_dir))
}

/// Makes run `id`'s folder in `runs_dir`: `<id>-<name>`, or, when that is taken (another store
/// sharing the runs folder has a run with that id), `<id>-<name>-2`, `-3`, ...: made with
/// `mkdir`, which fails on an existing folder, so no two runs ever share one.
fn new_run_dir(runs_dir: &Path, id: i64, name: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(runs_dir)
        .with_context(|| format!("creating the runs folder {}", runs_dir.display()))?;
    let base = format!("{id}-{}", sanitize(name));
    for n in 1..=1000 {
        let dir = match n {
            1 => runs_dir.join(&base),
            n => runs_dir.join(format!("{base}-{n}")),
        };
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(e).with_context(|| format!("creating run folder {}", dir.display()));
            }
        }
    }
    bail!(
        "{}: a thousand folders named {base}-N exist already; clean the runs folder",
        runs_dir.display()
    )
}

/// The directory recorded for run `run_id`.
fn run_dir_of(rt: &Runtime, store: &Store, run_id: i64) -> Result<PathBuf> {
    let run = rt
        .block_on(store.run(run_id))?
        .with_context(|| format!("run {run_id} vanished from the store"))?;
    Ok(PathBuf::from(&run.run_dir))
}

/// Trains run `run_id`, already recorded, to the end and records how it ended (on rank 0 of
/// `group` when there is one).
fn train_created(
    rt: &Runtime,
    store: &Store,
    run_id: i64,
    run_dir: &Path,
    cfg: &ExperimentConfig,
    group: Option<&SharedCollective>,
) -> Result<i64> {
    logging::to_file(&run_dir.join("harness.log"));
    tracing::info!(run = run_id, dir = %run_dir.display(), "run started");
    note!(
        "harness: run {run_id} ({}) in {}",
        cfg.trainer.experiment_name,
        run_dir.display()
    );
    let result = build_drive_export(rt, store, group, run_id, run_dir, cfg, None);
    finish(rt, store, run_id, cfg, result, None)
}

/// Trains as one rank of a data-parallel run. Rank 0 owns the run: it opens the store, records
/// the run (or takes the one the launcher recorded), writes metrics, checkpoints and the final
/// status, and broadcasts the run id; the other ranks never open the store or write in the run
/// directory. Returns the run id.
pub fn train_rank(
    rt: &Runtime,
    cfg: ExperimentConfig,
    member: Membership,
    me: &Rank,
) -> Result<i64> {
    rank::check_data_parallel(&cfg, me.world)?;
    if me.rank == 0 {
        let opened = (|| -> Result<(Store, i64, PathBuf)> {
            let store = rt.block_on(Store::open(&cfg.trainer.db_path()))?;
            let (id, dir) = match me.run_id {
                Some(id) => (id, run_dir_of(rt, &store, id)?),
                None => create_run(rt, &store, &cfg, member)?,
            };
            Ok((store, id, dir))
        })();
        // the others wait for the id: tell them at once when there is none
        let id = opened.as_ref().map_or(-1, |(_, id, _)| *id);
        broadcast_run_id(&me.group, id)?;
        let (store, id, dir) = opened?;
        train_created(rt, &store, id, &dir, &cfg, Some(&me.group))
    } else {
        let id = broadcast_run_id(&me.group, -1)?;
        if id < 0 {
            bail!("rank 0 could not open the run (see rank 0's error)");
        }
        let bars = Bars::hidden();
        let place = Place {
            store: None,
            group: Some(&me.group),
        };
        let dir = PathBuf::new();
        build_trainer_in(&cfg, None, Some(&me.group))
            .and_then(|mut built| {
                let outcome = drive(rt, place, id, &dir, &cfg, (&mut built, &bars), true)?;
                if matches!(outcome, Outcome::Finished) {
                    join_export(&built, &cfg)?;
                }
                Ok(outcome)
            })
            .and_then(|outcome| match outcome {
                Outcome::Finished => Ok(id),
                Outcome::Killed => bail!("run {id} stopped by a signal"),
            })
            .with_context(|| format!("rank {} of {} in run {id}", me.rank, me.world))
    }
}

/// Rank 0's `id`, on every rank.
fn broadcast_run_id(group: &SharedCollective, id: i64) -> Result<i64> {
    let mut t = tch::Tensor::from_slice(&[id]);
    dist::lock(group)?
        .broadcast(&mut t, 0)
        .context("sharing the run id from rank 0")?;
    Ok(t.int64_value(&[0]))
}

/// Marks run `id` failed with `error` (the launcher, when a rank died), unless it finished.
pub fn mark_failed(rt: &Runtime, store: &Store, id: i64, error: String) -> Result<()> {
    mark_ended(rt, store, id, "failed", Some(error))
}

/// Records run `id` as `status` (with `error`, also as an event) unless it already ended
/// otherwise: a `failed` run may have been `running`, `killed` or `failed` (a launcher's
/// diagnosis replaces a rank's), a `killed` one only `running`.
pub fn mark_ended(
    rt: &Runtime,
    store: &Store,
    id: i64,
    status: &'static str,
    error: Option<String>,
) -> Result<()> {
    let query = if status == "failed" {
        "UPDATE runs SET status = ?, ended = ?, heartbeat = ?, error = ? \
         WHERE id = ? AND status IN ('running', 'killed', 'failed')"
    } else {
        "UPDATE runs SET status = ?, ended = ?, heartbeat = ?, error = ? \
         WHERE id = ? AND status = 'running'"
    };
    rt.block_on(store.write(move |c| {
        Box::pin(async move {
            let t = now();
            let changed = sqlx::query(query)
                .bind(status)
                .bind(t)
                .bind(t)
                .bind(&error)
                .bind(id)
                .execute(&mut *c)
                .await?
                .rows_affected();
            if changed == 0 {
                return Ok(0);
            }
            if let Some(e) = &error {
                sqlx::query(
                    "INSERT INTO events (run_id, time, kind, message) VALUES (?, ?, 'error', ?)",
                )
                .bind(id)
                .bind(t)
                .bind(e)
                .execute(&mut *c)
                .await?;
            }
            tracker::enqueue_status(c, id, status, Some(t)).await?;
            Ok(0)
        })
    }))
    .with_context(|| format!("recording run {id} as {status}"))?;
    rt.block_on(store.flush())?;
    Ok(())
}

/// Resumes `spec` (an id or name) from its latest complete checkpoint, or from `from_step`.
pub fn resume(
    rt: &Runtime,
    db: &Path,
    spec: &str,
    from_step: Option<u64>,
    overrides: &[Override],
) -> Result<i64> {
    let store = rt.block_on(Store::open(db))?;
    let r = prepare_resume(rt, &store, spec, from_step, overrides, &|_| Ok(()))?;
    resume_prepared(rt, &store, &r, None)
}

/// A run claimed to continue from a checkpoint: marked running under this process, nothing
/// else changed yet ([`commit_resume`] rewinds it once the checkpoint is loaded).
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The run.
    pub id: i64,
    /// The checkpoint's step.
    pub step: u64,
    /// The checkpoint folder.
    pub ckpt_dir: PathBuf,
    /// The run's directory.
    pub run_dir: PathBuf,
    /// The config it continues with (the checkpoint's, with the overrides).
    pub cfg: ExperimentConfig,
    /// What the overrides change (`key: old -> new`).
    pub changes: Vec<String>,
    /// How the run stood before the claim, to put back if the resume fails before it
    /// rewinds the run; `None` where another process claimed it (the launcher's ranks).
    pub prior: Option<Prior>,
}

/// How a run stood before a resume claimed it.
#[derive(Debug, Clone)]
pub struct Prior {
    status: String,
    pid: Option<i64>,
    host: String,
    started: Option<f64>,
    heartbeat: Option<f64>,
    ended: Option<f64>,
    error: Option<String>,
}

impl Prior {
    fn of(run: &store::RunRow) -> Prior {
        Prior {
            status: run.status.clone(),
            pid: run.pid,
            host: run.host.clone(),
            started: run.started,
            heartbeat: run.heartbeat,
            ended: run.ended,
            error: run.error.clone(),
        }
    }
}

/// The config a resume from checkpoint folder `ckpt_dir` continues with (the stored one with
/// `overrides`) and what the overrides change; an error naming the first key that may not
/// change on resume.
fn resume_config(
    id: i64,
    ckpt_dir: &Path,
    overrides: &[Override],
) -> Result<(ExperimentConfig, Vec<String>)> {
    let stored = std::fs::read_to_string(ckpt_dir.join("config.json"))
        .with_context(|| format!("reading {}/config.json", ckpt_dir.display()))?;
    let old = config::from_stored(&stored, &[])
        .with_context(|| format!("the config stored in {}", ckpt_dir.display()))?;
    let cfg = config::from_stored(&stored, overrides)?;
    let changes = config::diff(&old, &cfg);
    if let Some((key, a, b)) = changes.iter().find(|(k, _, _)| !config::resume_safe(k)) {
        bail!(
            "resuming run {id}: config key `{key}` cannot change on resume ({a} -> {b}); \
             keys that may: {}",
            config::RESUME_SAFE_KEYS.join(", ")
        );
    }
    let changes = changes
        .iter()
        .map(|(k, a, b)| format!("{k}: {a} -> {b}"))
        .collect();
    Ok((cfg, changes))
}

/// Picks the checkpoint of `spec` (its latest one, or the one at `from_step`) and checks it is
/// whole and this run's ([`checkpoint::pick`]), checks the overrides are resume-safe, and claims
/// the run: marks it running under this process, in the transaction that checks nobody else
/// has. Nothing is dropped yet: a resume that fails before [`commit_resume`] puts the run back
/// as it was. `check` sees the config first, before anything is written.
pub fn prepare_resume(
    rt: &Runtime,
    store: &Store,
    spec: &str,
    from_step: Option<u64>,
    overrides: &[Override],
    check: &dyn Fn(&ExperimentConfig) -> Result<()>,
) -> Result<Resumed> {
    let run = rt.block_on(store.resolve_run(spec))?;
    let id = run.id;
    if let Some(why) = run.still_running() {
        bail!("{why}");
    }
    let ckpts = rt.block_on(store.checkpoints(id))?;
    let ckpt = checkpoint::pick(&ckpts, id, store.id(), spec, from_step)?;
    let ckpt_dir = PathBuf::from(&ckpt.path);
    let (cfg, changes) = resume_config(id, &ckpt_dir, overrides)?;
    check(&cfg)?;
    let prior = Prior::of(&run);
    let seen = prior.clone();
    rt.block_on(store.write(move |c| {
        Box::pin(async move {
            // The claim: checked and taken in one transaction, so of two resumes at once the
            // second sees the first's pid and refuses.
            let now_row = Store::run_on(c, id)
                .await?
                .with_context(|| format!("run {id} vanished from the store"))?;
            if let Some(why) = now_row.still_running() {
                bail!("{why}");
            }
            if now_row.status != seen.status || now_row.ended != seen.ended {
                bail!("run {id} changed while this resume read it; try again");
            }
            sqlx::query(
                "UPDATE runs SET status = 'running', pid = ?, host = ?, heartbeat = ? WHERE id = ?",
            )
            .bind(i64::from(std::process::id()))
            .bind(store::hostname())
            .bind(now())
            .bind(id)
            .execute(&mut *c)
            .await?;
            Ok(0)
        })
    }))
    .with_context(|| format!("claiming run {id} to resume it"))?;
    Ok(Resumed {
        id,
        step: ckpt.step as u64,
        ckpt_dir,
        run_dir: PathBuf::from(&run.run_dir),
        cfg,
        changes,
        prior: Some(prior),
    })
}

/// Rewinds a claimed run to its checkpoint, once the checkpoint is loaded: drops the metrics and
/// checkpoints past it (and their folders), records the resume and the config changes, and
/// rewinds the tracker's copy. From here on a failure is the run's, recorded as such.
fn commit_resume(rt: &Runtime, store: &Store, r: &Resumed) -> Result<()> {
    let (id, step) = (r.id, r.step as i64);
    let change_msgs = r.changes.clone();
    let removed: Vec<String> = rt
        .block_on(store.checkpoints(id))?
        .into_iter()
        .filter(|c| c.step > step)
        .map(|c| c.path)
        .collect();
    let config_json = config::to_json(&r.cfg)?;
    let tracked = r.cfg.clone();
    let dropped = rt
        .block_on(store.write(move |c| {
            Box::pin(async move {
                let t = now();
                let dropped = sqlx::query("DELETE FROM metrics WHERE run_id = ? AND step > ?")
                    .bind(id)
                    .bind(step)
                    .execute(&mut *c)
                    .await?
                    .rows_affected();
                for table in ["checkpoints", "generations"] {
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DELETE FROM {table} WHERE run_id = ? AND step > ?"
                    )))
                    .bind(id)
                    .bind(step)
                    .execute(&mut *c)
                    .await?;
                }
                sqlx::query(
                    "UPDATE runs SET status = 'running', started = ?, heartbeat = ?, ended = NULL, \
                     error = NULL, resumed_from = ?, config = ? WHERE id = ?",
                )
                .bind(t)
                .bind(t)
                .bind(step)
                .bind(&config_json)
                .bind(id)
                .execute(&mut *c)
                .await?;
                let mut events = vec![(
                    "resume",
                    format!("resumed from step {step}; {dropped} metric rows past it dropped"),
                )];
                events.extend(change_msgs.into_iter().map(|m| ("config_change", m)));
                for (kind, msg) in events {
                    sqlx::query("INSERT INTO events (run_id, time, kind, message) VALUES (?, ?, ?, ?)")
                        .bind(id)
                        .bind(t)
                        .bind(kind)
                        .bind(msg)
                        .execute(&mut *c)
                        .await?;
                }
                if dropped > 0
                    && tracked.trainer.tracker.kind != config::TrackerKind::None
                    && tracker::enqueue_rewind(c, id, step, &tracked).await?
                {
                    sqlx::query(
                        "INSERT INTO events (run_id, time, kind, message) VALUES (?, ?, 'tracker', ?)",
                    )
                    .bind(id)
                    .bind(t)
                    .bind("the remote run is replaced by a fresh copy without the dropped metrics")
                    .execute(&mut *c)
                    .await?;
                }
                tracker::enqueue_status(c, id, "running", None).await?;
                Ok(dropped as i64)
            })
        }))
        .with_context(|| format!("resuming run {id} from step {step}"))?;
    for path in removed {
        std::fs::remove_dir_all(&path).ok();
    }
    tracing::debug!(
        run = id,
        step,
        dropped,
        "metric rows past the checkpoint dropped"
    );
    Ok(())
}

/// Puts a claimed run back as it stood before the claim, when the resume failed before
/// [`commit_resume`] (which sets `started`, so a committed run is never put back); records why
/// in an event. Returns whether it did.
pub fn restore_claim(rt: &Runtime, store: &Store, r: &Resumed, error: &str) -> Result<bool> {
    let Some(p) = r.prior.clone() else {
        return Ok(false);
    };
    let (id, step) = (r.id, r.step);
    let message = format!(
        "resume from step {step} failed before training: {error}; the run is left {} as it was",
        p.status
    );
    let restored = rt.block_on(store.write(move |c| {
        Box::pin(async move {
            let n = sqlx::query(
                "UPDATE runs SET status = ?, pid = ?, host = ?, heartbeat = ?, ended = ?, \
                 error = ? WHERE id = ? AND started IS ?",
            )
            .bind(&p.status)
            .bind(p.pid)
            .bind(&p.host)
            .bind(p.heartbeat)
            .bind(p.ended)
            .bind(&p.error)
            .bind(id)
            .bind(p.started)
            .execute(&mut *c)
            .await?
            .rows_affected();
            if n > 0 {
                sqlx::query(
                    "INSERT INTO events (run_id, time, kind, message) VALUES (?, ?, 'resume_failed', ?)",
                )
                .bind(id)
                .bind(now())
                .bind(&message)
                .execute(&mut *c)
                .await?;
            }
            Ok(n as i64)
        })
    }))?;
    Ok(restored > 0)
}

/// Trains a prepared run from its checkpoint to the end (on rank 0 of `group` when there is
/// one) and records how it ended.
fn resume_prepared(
    rt: &Runtime,
    store: &Store,
    r: &Resumed,
    group: Option<&SharedCollective>,
) -> Result<i64> {
    let (id, step, ckpt_dir, run_dir, cfg) = (r.id, r.step, &r.ckpt_dir, &r.run_dir, &r.cfg);
    logging::to_file(&run_dir.join("harness.log"));
    tracing::info!(run = id, step, "resuming from {}", ckpt_dir.display());
    note!("harness: resuming run {id} from {}", ckpt_dir.display());
    // What a process killed while saving left behind; this resume owns the run now.
    checkpoint::remove_partial(run_dir);
    let result = build_drive_export(rt, store, group, id, run_dir, cfg, Some(r));
    finish(rt, store, id, cfg, result, Some(r))
}

/// Builds the trainer (loading the checkpoint of `resumed`, if any), drives it to the end and
/// exports what a finished run trained.
fn build_drive_export(
    rt: &Runtime,
    store: &Store,
    group: Option<&SharedCollective>,
    run_id: i64,
    run_dir: &Path,
    cfg: &ExperimentConfig,
    resumed: Option<&Resumed>,
) -> Result<Outcome> {
    let bars = Bars::new();
    let mut built = build_trainer_in(cfg, Some(bars.generation_hook()), group)?;
    if let Some(r) = resumed {
        load_resumed(&mut built, r)?;
        // loaded: only now is the run rewound (a resume that failed so far left it as it was)
        commit_resume(rt, store, r)?;
    }
    let place = Place {
        store: Some(store),
        group,
    };
    let fresh = resumed.is_none();
    let outcome = drive(rt, place, run_id, run_dir, cfg, (&mut built, &bars), fresh)?;
    // an evaluation trained nothing to export
    if matches!(outcome, Outcome::Finished) && !config::eval_only(cfg) {
        export(&built, run_dir, cfg)?;
    }
    Ok(outcome)
}

/// Loads the checkpoint of `r` into a freshly built trainer and checks its step.
fn load_resumed(built: &mut Built, r: &Resumed) -> Result<()> {
    let trainer = &mut built.trainer;
    trainer
        .load_checkpoint(&r.ckpt_dir.join("trainer"))
        .with_context(|| format!("resuming run {} from {}", r.id, r.ckpt_dir.display()))?;
    if trainer.global_step() != r.step {
        bail!(
            "checkpoint {} holds step {} but is recorded as step {}",
            r.ckpt_dir.display(),
            trainer.global_step(),
            r.step
        );
    }
    Ok(())
}

/// Resumes as one rank of a data-parallel run. Rank 0 rewinds the run in the store
/// ([`prepare_resume`]) unless the launcher did (`HARNESS_RESUME_CHECKPOINT` set), and tells
/// the others the checkpoint folder; every rank reads the config from it (with `overrides`,
/// the same on every rank) and loads it; rank 0 alone writes the store.
pub fn resume_rank(
    rt: &Runtime,
    db: &Path,
    spec: &str,
    from_step: Option<u64>,
    overrides: &[Override],
    me: &Rank,
) -> Result<Option<i64>> {
    let prepared = if me.rank == 0 {
        let r = (|| -> Result<(Store, Resumed)> {
            let store = rt.block_on(Store::open(db))?;
            let r = match std::env::var_os(rank::RESUME_CHECKPOINT_ENV) {
                Some(dir) => {
                    let id = me
                        .run_id
                        .context("HARNESS_RESUME_CHECKPOINT is set without HARNESS_RUN_ID")?;
                    resumed_from_dir(rt, &store, id, Path::new(&dir), overrides)?
                }
                None => prepare_resume(rt, &store, spec, from_step, overrides, &|cfg| {
                    rank::check_data_parallel(cfg, me.world)
                })?,
            };
            Ok((store, r))
        })();
        share_path(&me.group, &prepared_id_and_path(&r))?;
        Some(r?)
    } else {
        None
    };
    match prepared {
        Some((store, r)) => {
            rank::check_data_parallel(&r.cfg, me.world)?;
            resume_prepared(rt, &store, &r, Some(&me.group)).map(Some)
        }
        None => {
            let shared = share_path(&me.group, "")?;
            // rank 0's run id comes with its folder: under an outside launcher (no
            // HARNESS_RUN_ID) the other ranks learn it only from rank 0
            let Some((id, dir)) = shared
                .split_once('\n')
                .and_then(|(id, dir)| Some((id.parse::<i64>().ok()?, dir.to_string())))
            else {
                bail!("rank 0 could not prepare the resume (see rank 0's error)");
            };
            let r = resumed_from_dir_readonly(id, Path::new(&dir), overrides)?;
            rank::check_data_parallel(&r.cfg, me.world)?;
            let bars = Bars::hidden();
            let place = Place {
                store: None,
                group: Some(&me.group),
            };
            build_trainer_in(&r.cfg, None, Some(&me.group))
                .and_then(|mut built| {
                    load_resumed(&mut built, &r)?;
                    let outcome = drive(
                        rt,
                        place,
                        id,
                        &r.run_dir,
                        &r.cfg,
                        (&mut built, &bars),
                        false,
                    )?;
                    if matches!(outcome, Outcome::Finished) {
                        join_export(&built, &r.cfg)?;
                    }
                    Ok(outcome)
                })
                .and_then(|outcome| match outcome {
                    Outcome::Finished => Ok(None),
                    Outcome::Killed => bail!("stopped by a signal"),
                })
                .with_context(|| format!("rank {} of {} resuming from {dir}", me.rank, me.world))
        }
    }
}

/// `<run id>\n<checkpoint folder>` of a prepared resume, empty when rank 0 could not prepare it.
fn prepared_id_and_path(p: &Result<(Store, Resumed)>) -> String {
    p.as_ref()
        .map(|(_, r)| format!("{}\n{}", r.id, r.ckpt_dir.display()))
        .unwrap_or_default()
}

/// Rank 0's `path` on every rank (empty when rank 0 has none).
fn share_path(group: &SharedCollective, path: &str) -> Result<String> {
    let all = dist::all_gather_bytes(&mut *dist::lock(group)?, path.as_bytes())
        .context("sharing the checkpoint folder from rank 0")?;
    Ok(String::from_utf8_lossy(&all[0]).into_owned())
}

/// The resume the launcher prepared: checkpoint `dir` of run `id` (its step from
/// `harness.json`), the config from its `config.json` with `overrides`.
fn resumed_from_dir(
    rt: &Runtime,
    store: &Store,
    id: i64,
    dir: &Path,
    overrides: &[Override],
) -> Result<Resumed> {
    let mut r = resumed_from_dir_readonly(id, dir, overrides)?;
    r.run_dir = run_dir_of(rt, store, id)?;
    Ok(r)
}

/// [`resumed_from_dir`] without the store (the ranks other than 0; `run_dir` is left empty).
fn resumed_from_dir_readonly(id: i64, dir: &Path, overrides: &[Override]) -> Result<Resumed> {
    let meta = checkpoint::read_meta(dir)?;
    let (cfg, changes) = resume_config(id, dir, overrides)
        .with_context(|| format!("the config stored in {}", dir.display()))?;
    Ok(Resumed {
        id,
        step: meta.step,
        ckpt_dir: dir.to_path_buf(),
        run_dir: PathBuf::new(),
        cfg,
        changes,
        prior: None,
    })
}

/// Records how a drive ended and turns a kill into an error for the exit code.
fn finish(
    rt: &Runtime,
    store: &Store,
    id: i64,
    cfg: &ExperimentConfig,
    result: Result<Outcome>,
    resumed: Option<&Resumed>,
) -> Result<i64> {
    let (status, error) = match &result {
        Ok(Outcome::Finished) => ("finished", None),
        Ok(Outcome::Killed) => ("killed", None),
        Err(e) => {
            let e = crate::console::one_line(e);
            match rank::launcher_gone(Duration::from_secs(2)) {
                Some(why) => ("failed", Some(format!("{why}, so its ranks stopped ({e})"))),
                None => ("failed", Some(e)),
            }
        }
    };
    // A resume that failed before it rewound the run leaves the run as it was.
    let restored = match (resumed, &error) {
        (Some(r), Some(e)) => restore_claim(rt, store, r, e).unwrap_or_else(|why| {
            tracing::error!("run {id}: putting it back as it was: {why:#}");
            false
        }),
        _ => false,
    };
    if restored {
        note!("harness: run {id} is left as it was before this resume");
    } else {
        let event = error.clone().map(|e| ("error", e));
        rt.block_on(record_end(store, id, status, error, event));
    }
    if cfg.trainer.tracker.kind != config::TrackerKind::None {
        let budget = Duration::from_secs_f64(cfg.trainer.tracker.flush_timeout_s);
        rt.block_on(tracker::flush_run(store, id, &cfg.trainer.tracker, budget));
    }
    tracing::info!(run = id, status, "run ended");
    match result {
        Ok(Outcome::Finished) => Ok(id),
        Ok(Outcome::Killed) => {
            let resumable = rt
                .block_on(store.checkpoints(id))
                .map(|c| !c.is_empty())
                .unwrap_or(true);
            if resumable {
                bail!("run {id} stopped by a signal; `harness resume {id}` continues it")
            }
            bail!(
                "run {id} stopped by a signal before its first checkpoint: there is nothing to \
                 resume; start it again"
            )
        }
        Err(e) => Err(e.context(format!("run {id} failed"))),
    }
}

/// The TensorBoard event file of `trainer.tensorboard`, if one is written.
struct Board(Option<crate::integrations::tensorboard::EventWriter>);

impl Board {
    /// A new event file in `trainer.tensorboard_dir`, else `$TENSORBOARD_DIR` (verl's), else
    /// `<run dir>/tensorboard`, starting at `first_step`.
    fn open(t: &config::HarnessConfig, run_dir: &Path, first_step: u64) -> Result<Board> {
        let dir = t
            .tensorboard_dir
            .clone()
            .or_else(|| std::env::var_os("TENSORBOARD_DIR").map(PathBuf::from))
            .unwrap_or_else(|| run_dir.join("tensorboard"));
        let w = crate::integrations::tensorboard::EventWriter::create(&dir, first_step)?;
        tracing::info!("TensorBoard events in {}", w.path().display());
        Ok(Board(Some(w)))
    }

    /// Writes a step's metrics; a file that cannot be written is given up with a warning (the
    /// store keeps every metric).
    fn write(&mut self, step: u64, m: &StepMetrics) {
        if let Some(w) = &mut self.0
            && let Err(e) = w.scalars(step, m)
        {
            note!("harness: warning: {e:#}; no more TensorBoard events for this run");
            self.0 = None;
        }
    }
}

/// Records the first `trainer.log_val_generations` samples of a validation. A store that
/// refuses them costs the samples, not the run (a warning says so).
fn record_generations(
    rt: &Runtime,
    store: &Store,
    run: i64,
    step: u64,
    samples: Vec<rl_core::Sample>,
    t: &config::HarnessConfig,
) {
    if t.log_val_generations == 0 || samples.is_empty() {
        return;
    }
    let rows: Vec<store::GenerationRow> = samples
        .into_iter()
        .take(t.log_val_generations)
        .map(|s| store::GenerationRow {
            step: step as i64,
            data_source: s.data_source,
            prompt: s.prompt,
            response: s.response,
            score: s.score,
        })
        .collect();
    let recorded = rt.block_on(store.write(move |c| {
        Box::pin(async move {
            Store::insert_generations(c, run, step, &rows).await?;
            tracker::enqueue_generations(c, run, step as i64).await?;
            Ok(0)
        })
    }));
    if let Err(e) = recorded {
        tracing::warn!("run {run}: the validation generations of step {step}: {e:#}");
    }
}

/// On an accelerator, the step's peaks of the caching allocator in GiB under verl's names
/// (`perf/max_memory_allocated_gb`: live tensors, `perf/max_memory_reserved_gb`: what the
/// allocator took from the device, the figure that decides whether a run fits); this rank's, on
/// a data-parallel run rank 0's reach the store. Nothing on the CPU, which has no such
/// allocator (and whose RSS would make metrics differ between otherwise equal runs).
fn insert_device_memory(m: &mut StepMetrics, device: tch::Device) -> Result<()> {
    let Some(mem) = device_memory::stats(device).context("the step's peak device memory")? else {
        return Ok(());
    };
    const GIB: f64 = (1u64 << 30) as f64;
    m.insert(
        "perf/max_memory_allocated_gb".into(),
        mem.peak_allocated as f64 / GIB,
    );
    m.insert(
        "perf/max_memory_reserved_gb".into(),
        mem.peak_reserved as f64 / GIB,
    );
    Ok(())
}

/// Whether step `step` gets a console line (`trainer.console_every_steps`; absent: every step
/// where stderr is not a terminal).
fn console_due(every: Option<u64>, step: u64, total: u64) -> bool {
    let every = every.unwrap_or(if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        0
    } else {
        1
    });
    every > 0 && (step.is_multiple_of(every) || step == total)
}

/// The metrics the console line shows first, when a step has them.
const CONSOLE_KEYS: &[&str] = &[
    "critic/score/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "critic/vf_loss",
    "response_length/mean",
    "train/loss",
    "rewards/accuracies",
    "rm/loss",
    "rm/accuracy",
    "timing_s/step",
    "perf/throughput",
];

/// verl's console line: `step:12/40 - critic/score/mean:0.5312 - ... - val/...`, the key
/// metrics the step has ([`CONSOLE_KEYS`]) and every validation metric.
fn console_line(step: u64, total: u64, m: &StepMetrics) -> String {
    let num = |v: f64| {
        let a = v.abs();
        if v == 0.0 || (1e-3..1e5).contains(&a) {
            format!("{v:.4}")
        } else {
            format!("{v:.3e}")
        }
    };
    let mut parts = vec![format!("step:{step}/{total}")];
    parts.extend(
        CONSOLE_KEYS
            .iter()
            .filter_map(|k| m.get(*k).map(|v| format!("{k}:{}", num(*v)))),
    );
    parts.extend(
        m.iter()
            .filter(|(k, _)| k.starts_with("val/"))
            .map(|(k, v)| format!("{k}:{}", num(*v))),
    );
    parts.join(" - ")
}

fn is_due(freq: i64, step: u64, total: u64) -> bool {
    freq > 0 && (step.is_multiple_of(freq as u64) || step == total)
}

/// The non-finite-loss guard of `trainer.max_nonfinite_steps`: counts consecutive steps whose
/// loss (any metric named `*loss`) is NaN or infinite.
struct Divergence {
    patience: u64,
    /// The first step of the current run of non-finite steps, and the metric that showed it.
    since: Option<(u64, String, f64)>,
    streak: u64,
}

impl Divergence {
    fn new(patience: u64) -> Self {
        Divergence {
            patience,
            since: None,
            streak: 0,
        }
    }

    /// Takes step `step`'s metrics; whether its loss is finite.
    fn observe(&mut self, step: u64, m: &StepMetrics) -> bool {
        let bad = m.iter().find(|(k, v)| {
            k.rsplit('/').next().is_some_and(|l| l.ends_with("loss")) && !v.is_finite()
        });
        match bad {
            None => {
                self.since = None;
                self.streak = 0;
                true
            }
            Some((k, v)) => {
                self.streak += 1;
                self.since.get_or_insert((step, k.clone(), *v));
                false
            }
        }
    }

    /// The error that stops the run: `patience` non-finite steps in a row, or a last step
    /// (`last`) with a non-finite loss (a run never ends `finished` with a diverged model).
    fn verdict(&self, last: bool) -> Option<String> {
        let (since, key, value) = self.since.as_ref()?;
        if self.patience == 0 || (self.streak < self.patience && !last) {
            return None;
        }
        Some(format!(
            "training diverged at step {since}: {key} = {value} and the loss stayed non-finite \
             for {} step(s) (trainer.max_nonfinite_steps = {})",
            self.streak, self.patience
        ))
    }
}

/// Where a drive writes: the store (rank 0 or a plain process; `None` on the other ranks,
/// which write nothing) and the data-parallel group, if any.
#[derive(Clone, Copy)]
struct Place<'a> {
    store: Option<&'a Store>,
    group: Option<&'a SharedCollective>,
}

/// Checkpoints the current step: rank 0, which holds the store, writes and records it; the
/// other ranks of a group only take part in the trainer's collectives (gathering a
/// ZeRO-sharded optimiser state) and write nothing.
fn checkpoint_now(
    rt: &Runtime,
    place: &Place<'_>,
    run_id: i64,
    run_dir: &Path,
    cfg: &ExperimentConfig,
    trainer: &dyn rl_core::Trainer,
) -> Result<()> {
    match (place.store, place.group) {
        (Some(store), _) => checkpoint::save(rt, store, run_id, run_dir, cfg, trainer),
        (None, Some(_)) => trainer.save_checkpoint(Path::new("")).with_context(|| {
            format!(
                "joining rank 0's checkpoint of step {}",
                trainer.global_step()
            )
        }),
        (None, None) => Ok(()),
    }
}

/// Whether any rank of `group` saw a stop signal (every rank stops after the same step); `stop`
/// itself without a group.
fn agreed_stop(group: Option<&SharedCollective>, stop: bool) -> Result<bool> {
    let Some(g) = group else {
        return Ok(stop);
    };
    let mut v = [f64::from(u8::from(stop))];
    dist::all_reduce_f64(&mut *dist::lock(g)?, &mut v, dist::ReduceOp::Max)
        .context("agreeing on a stop signal with the other ranks")?;
    Ok(v[0] > 0.0)
}

/// Stops at the first SIGINT, SIGTERM or SIGHUP (a closed terminal) after the current step,
/// with a checkpoint, and says so. A second one stops at once when `at_once` names the store and
/// run to record as killed; the launcher passes none, as it stops its ranks itself.
pub(crate) fn stop_on_signal(
    rt: &Runtime,
    stop: Arc<AtomicBool>,
    at_once: Option<(Store, i64)>,
) -> tokio::task::JoinHandle<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let _guard = rt.enter();
    // Registered before this returns: no signal from here on takes the default action.
    let streams = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    );
    rt.spawn(async move {
        let (Ok(mut int), Ok(mut term), Ok(mut hup)) = streams else {
            return;
        };
        let mut stopping = false;
        loop {
            let name = tokio::select! {
                _ = int.recv() => "SIGINT",
                _ = term.recv() => "SIGTERM",
                // a closed terminal: the launcher's ranks are in their own process groups and
                // do not get the terminal's SIGHUP, so the launcher stops them
                _ = hup.recv() => "SIGHUP",
            };
            if !stopping {
                stopping = true;
                stop.store(true, Ordering::SeqCst);
                let again = if at_once.is_some() {
                    " (Ctrl-C again to stop at once)"
                } else {
                    ""
                };
                note!("harness: {name}: stopping after this step, with a checkpoint{again}");
                continue;
            }
            let Some((store, run)) = &at_once else {
                continue;
            };
            note!("harness: {name} again: stopping now; the run resumes from its last checkpoint");
            // A store that hangs must not hold the exit up: a few seconds, then go anyway.
            let recorded = tokio::time::timeout(
                Duration::from_secs(5),
                record_end(
                    store,
                    *run,
                    "killed",
                    None,
                    Some((
                        "signal",
                        format!("stopped at once by a second {name}, in the middle of a step"),
                    )),
                ),
            )
            .await;
            if recorded.is_err() {
                note!("harness: run {run}: the store did not take the stop in 5 s; exiting anyway");
            }
            std::process::exit(130);
        }
    })
}

/// Records how run `run` ended (status, error, an event, the tracker's status) in one
/// transaction; if the store refuses it, the end is owed like a metric (retried, spilled).
async fn record_end(
    store: &Store,
    run: i64,
    status: &'static str,
    error: Option<String>,
    event: Option<(&'static str, String)>,
) {
    let err2 = error.clone();
    let recorded = store
        .write(move |c| {
            Box::pin(async move {
                let t = now();
                sqlx::query(
                    "UPDATE runs SET status = ?, ended = ?, heartbeat = ?, error = ? WHERE id = ?",
                )
                .bind(status)
                .bind(t)
                .bind(t)
                .bind(&err2)
                .bind(run)
                .execute(&mut *c)
                .await?;
                if let Some((kind, message)) = &event {
                    sqlx::query(
                        "INSERT INTO events (run_id, time, kind, message) VALUES (?, ?, ?, ?)",
                    )
                    .bind(run)
                    .bind(t)
                    .bind(kind)
                    .bind(message)
                    .execute(&mut *c)
                    .await?;
                }
                tracker::enqueue_status(c, run, status, Some(t)).await?;
                Ok(0)
            })
        })
        .await;
    if let Err(e) = recorded {
        tracing::error!("recording the end of run {run}: {e:#}");
        if let Err(e) = store.end_owed(run, status, error) {
            tracing::error!("run {run}: {e:#}");
        }
    }
    if let Err(e) = store.flush().await {
        tracing::error!("run {run}: {e:#}");
    }
}

/// The loop: validation, steps, metrics, checkpoints, heartbeat, signals.
fn drive(
    rt: &Runtime,
    place: Place<'_>,
    run_id: i64,
    run_dir: &Path,
    cfg: &ExperimentConfig,
    (built, bars): (&mut Built, &Bars),
    fresh: bool,
) -> Result<Outcome> {
    let device = built.device;
    let trainer = &mut built.trainer;
    let t = &cfg.trainer;
    let total = if config::eval_only(cfg) {
        0
    } else {
        trainer.total_steps()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let _guard = rt.enter();
    let store = place.store;
    let heartbeat = store.map(|store| {
        let store = store.clone();
        let period = Duration::from_secs_f64(t.heartbeat_s);
        rt.spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                if store.heartbeat(run_id).is_err() {
                    break;
                }
            }
        })
    });
    let signals = stop_on_signal(rt, stop.clone(), store.map(|s| (s.clone(), run_id)));
    let pump = store
        .filter(|_| t.tracker.kind != config::TrackerKind::None)
        .map(|store| tracker::Pump::start(rt, store.clone(), run_id, t.tracker.clone()));
    let stop_when = t
        .stop_when
        .as_deref()
        .map(crate::store::filter::StopWhen::parse)
        .transpose()
        .context("config key `trainer.stop_when`")?;
    // rank 0 alone writes; a resume writes from the step after its checkpoint on
    let mut board = match store.filter(|_| t.tensorboard) {
        Some(_) => Board::open(t, run_dir, trainer.global_step() + u64::from(!fresh))?,
        None => Board(None),
    };
    let bar = &bars.step;
    bar.set_length(total);
    bar.set_position(trainer.global_step());
    let result = (|| -> Result<Outcome> {
        if fresh && t.val_before_train {
            let (m, samples) = trainer.validate().context("validation before training")?;
            board.write(trainer.global_step(), &m);
            if let Some(store) = store {
                store.log_metrics(run_id, trainer.global_step(), &m)?;
                record_generations(rt, store, run_id, trainer.global_step(), samples, t);
            }
            tracing::info!(step = trainer.global_step(), ?m, "validation");
        }
        // the step of the newest checkpoint; a fresh run has none yet
        let mut last_ckpt = (!fresh).then(|| trainer.global_step());
        let mut diverged = Divergence::new(t.max_nonfinite_steps);
        while trainer.global_step() < total {
            if agreed_stop(place.group, stop.load(Ordering::SeqCst))? {
                let step = trainer.global_step();
                // a stop before the first step checkpoints step 0, so that the resume the
                // message offers has something to continue from
                if last_ckpt.is_none_or(|c| step > c) && diverged.since.is_none() {
                    checkpoint_now(rt, &place, run_id, run_dir, cfg, trainer.as_ref())?;
                }
                if let Some(store) = store {
                    store.event(
                        Some(run_id),
                        "signal",
                        format!("stopped by a signal after step {step}"),
                    )?;
                }
                return Ok(Outcome::Killed);
            }
            let started = Instant::now();
            let before = trainer.global_step();
            device_memory::reset_peak(device)?;
            let mut m: StepMetrics = trainer
                .step()
                .with_context(|| format!("training step {}", before + 1))?;
            let step = trainer.global_step();
            // the step as the driver timed it (with the metrics' reduction over the ranks)
            let seconds = started.elapsed().as_secs_f64();
            m.insert("timing_s/step".into(), seconds);
            m.insert("perf/time_per_step".into(), seconds);
            insert_device_memory(&mut m, device)?;
            let healthy = diverged.observe(step, &m);
            let mut stopped_early = None;
            if is_due(t.test_freq, step, total) {
                let (v, samples) = trainer
                    .validate()
                    .with_context(|| format!("validation at step {step}"))?;
                if let Some(store) = store {
                    record_generations(rt, store, run_id, step, samples, t);
                }
                tracing::info!(step, ?v, "validation");
                // every rank validates to the same (reduced) metrics, so all ranks agree
                if let Some(cond) = &stop_when {
                    stopped_early = cond.met(&v)?;
                }
                m.extend(v);
            }
            if store.is_some() && console_due(t.console_every_steps, step, total) {
                bars.println(&console_line(step, total, &m));
            }
            board.write(step, &m);
            if let Some(store) = store {
                store.log_metrics(run_id, step, &m)?;
                // Rows it refuses wait and are retried; a store that refuses for too long
                // fails the run instead of letting it train on unrecorded.
                store.check(t.store_patience_s)?;
            }
            // every rank decides alike (the metrics and the validation are reduced), so the
            // ranks gather a sharded optimiser state together
            let due = is_due(t.save_freq, step, total)
                || (stopped_early.is_some() && last_ckpt.is_none_or(|c| step > c));
            if due && !healthy {
                if let Some(store) = store {
                    store.event(
                        Some(run_id),
                        "nonfinite",
                        format!("no checkpoint of step {step}: its loss is not finite"),
                    )?;
                }
            } else if due {
                checkpoint_now(rt, &place, run_id, run_dir, cfg, trainer.as_ref())?;
                last_ckpt = Some(step);
            }
            if let Some(why) = diverged.verdict(step == total) {
                let resume = match last_ckpt {
                    Some(c) => format!(
                        "; its newest checkpoint, step {c}, was taken before that: `harness resume \
                         {run_id} --from-step {c}` with a lower learning rate continues from it"
                    ),
                    None => "; it has no checkpoint from before that".into(),
                };
                bail!("{why}{resume}");
            }
            if let Some(why) = stopped_early {
                tracing::info!(step, "trainer.stop_when: {why}; training ends here");
                if let Some(store) = store {
                    store.event(
                        Some(run_id),
                        "stop_when",
                        format!("stopped after step {step} of {total}: {why}"),
                    )?;
                    rt.block_on(store.flush())?;
                }
                bar.set_position(step);
                return Ok(Outcome::Finished);
            }
            bar.set_position(step);
            if let Some(score) = m.get("critic/score/mean") {
                bar.set_message(format!("score {score:.3}"));
            }
        }
        if let Some(store) = store {
            rt.block_on(store.flush())?;
        }
        Ok(Outcome::Finished)
    })();
    bars.finish();
    if let Some(h) = heartbeat {
        h.abort();
    }
    signals.abort();
    if let Some(p) = pump {
        p.stop(rt);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use rl_workers::Progress;

    #[test]
    fn the_generation_hook_drives_the_generation_bar() {
        let bars = Bars::new();
        let hook = bars.generation_hook();
        let p = |step| Progress {
            step,
            max_steps: 8,
            total_rows: 32,
            finished_rows: 4,
            generated_tokens: 96,
        };
        hook(&p(1));
        hook(&p(3));
        assert_eq!(bars.generation.length(), Some(8));
        assert_eq!(bars.generation.position(), 3);
        assert!(
            bars.generation
                .message()
                .contains("4/32 rows done, 96 tokens")
        );
        // the next generation starts the bar over
        hook(&p(1));
        assert_eq!(bars.generation.position(), 1);
    }
}
