//! The SQLite run store (sqlx): WAL, a busy timeout, migrations serialised by a file lock, and
//! one writer task per process that applies writes in order, batching metrics, heartbeats and
//! events into one `BEGIN IMMEDIATE` transaction per drain.
//!
//! The lowest layer of the harness above its leaves: runs, metrics, events and checkpoints as
//! rows, and the queries over them ([`filter`], the language of `runs --filter` and
//! `trainer.stop_when`). It knows no experiment config (a run's config is stored as JSON), so
//! `config` can use it and not the other way round.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection, Row};
use tokio::sync::{mpsc, oneshot};

pub mod filter;
mod writer;

use writer::{Op, QueuedEnd, QueuedEvent, SharedHealth};

/// A boxed future borrowing the writer's connection.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A write run by the writer task in its own transaction; returns an integer (an id, a count).
pub type WriteFn =
    Box<dyn for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<i64>> + Send>;

/// Now, as Unix seconds.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A handle on the run store. Cheap to clone; all clones share one writer task.
#[derive(Clone)]
pub struct Store {
    pool: SqlitePool,
    tx: mpsc::UnboundedSender<Op>,
    path: PathBuf,
    health: SharedHealth,
    read_only: bool,
    id: String,
}

/// What [`Store::summaries`] finds for one metric of one run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MetricSummary {
    /// (step, value) of the last record.
    pub last: Option<(i64, f64)>,
    /// The largest non-NaN value and the first step it was reached.
    pub max: Option<(i64, f64)>,
    /// The smallest non-NaN value and the first step it was reached.
    pub min: Option<(i64, f64)>,
    /// The last value at or before the asked step.
    pub at: Option<f64>,
}

/// One row of `runs`.
#[derive(Debug, Clone)]
pub struct RunRow {
    /// Run id.
    pub id: i64,
    /// `trainer.experiment_name`.
    pub name: String,
    /// `trainer.project_name`.
    pub project: String,
    /// Stored status (see [`RunRow::effective_status`] for dead detection).
    pub status: String,
    /// Resolved config, JSON.
    pub config: String,
    /// `git rev-parse HEAD` where the run started.
    pub git_commit: Option<String>,
    /// Whether the work tree had uncommitted changes.
    pub git_dirty: Option<bool>,
    /// Host name.
    pub host: String,
    /// Process id of the process driving it.
    pub pid: Option<i64>,
    /// `trainer.seed`.
    pub seed: i64,
    /// The run directory.
    pub run_dir: String,
    /// Times (Unix seconds).
    pub created: f64,
    /// When training started (last start, on resume).
    pub started: Option<f64>,
    /// When it ended.
    pub ended: Option<f64>,
    /// Last heartbeat.
    pub heartbeat: Option<f64>,
    /// Heartbeat interval.
    pub heartbeat_s: f64,
    /// Parent sweep.
    pub sweep_id: Option<String>,
    /// Trial id within the sweep.
    pub trial_id: Option<String>,
    /// Checkpoint step of the latest resume.
    pub resumed_from: Option<i64>,
    /// The one-line cause of a failure.
    pub error: Option<String>,
    /// The pids of a `--nproc-per-node` run's ranks (`pid` is the launcher's).
    pub rank_pids: Vec<i64>,
}

impl RunRow {
    fn from_row(r: &sqlx::sqlite::SqliteRow) -> RunRow {
        RunRow {
            id: r.get("id"),
            name: r.get("name"),
            project: r.get("project"),
            status: r.get("status"),
            config: r.get("config"),
            git_commit: r.get("git_commit"),
            git_dirty: r.get::<Option<i64>, _>("git_dirty").map(|d| d != 0),
            host: r.get("host"),
            pid: r.get("pid"),
            seed: r.get("seed"),
            run_dir: r.get("run_dir"),
            created: r.get("created"),
            started: r.get("started"),
            ended: r.get("ended"),
            heartbeat: r.get("heartbeat"),
            heartbeat_s: r.get("heartbeat_s"),
            sweep_id: r.get("sweep_id"),
            trial_id: r.get("trial_id"),
            resumed_from: r.get("resumed_from"),
            error: r.get("error"),
            rank_pids: r
                .get::<Option<String>, _>("rank_pids")
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect(),
        }
    }

    /// Why it cannot be resumed or started again now: it is alive in another process.
    pub fn still_running(&self) -> Option<String> {
        (self.effective_status() == "running").then(|| {
            format!(
                "run {} is still running (pid {} on {}, heartbeat {:.0} s ago)",
                self.id,
                self.pid.unwrap_or(-1),
                self.host,
                now() - self.heartbeat.unwrap_or(self.created)
            )
        })
    }

    /// `dead` for a run stored as running whose process is gone (same host) or whose heartbeat
    /// is older than three intervals; the stored status otherwise.
    pub fn effective_status(&self) -> &str {
        if self.status != "running" {
            return &self.status;
        }
        // the launcher and its ranks: alive while any of them is
        if self.host == hostname()
            && let Some(pid) = self.pid
            && !pid_alive(pid)
            && !self.rank_pids.iter().any(|&p| pid_alive(p))
        {
            return "dead";
        }
        let last = self.heartbeat.or(self.started).unwrap_or(self.created);
        if now() - last > 3.0 * self.heartbeat_s + 1.0 {
            "dead"
        } else {
            "running"
        }
    }
}

/// This machine's host name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown".into())
}

/// Whether a process lives (and is not a zombie) on this host.
pub fn pid_alive(pid: i64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !matches!(rest.trim_start().chars().next(), Some('Z' | 'X')))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// One recorded checkpoint.
#[derive(Debug, Clone)]
pub struct CheckpointRow {
    /// Step.
    pub step: i64,
    /// Folder.
    pub path: String,
    /// When recorded.
    pub created: f64,
    /// The checksums of its files (JSON), as its `harness.json` holds them; `None` for a
    /// checkpoint from before checksums.
    pub manifest: Option<String>,
}

/// One recorded validation generation (`trainer.log_val_generations`).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRow {
    /// The validation's step.
    pub step: i64,
    /// The row's `data_source`.
    pub data_source: String,
    /// The prompt as text.
    pub prompt: String,
    /// The response as text.
    pub response: String,
    /// Its score (NaN when none).
    pub score: f64,
}

/// One event.
#[derive(Debug, Clone)]
pub struct EventRow {
    /// When.
    pub time: f64,
    /// Kind (`error`, `resume`, `config_change`, `tracker`, `signal`, ...).
    pub kind: String,
    /// What happened.
    pub message: String,
}

impl Store {
    /// Opens (creating if needed) the store at `path` and starts its writer task; must be
    /// called inside a tokio runtime.
    pub async fn open(path: &Path) -> Result<Store> {
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the run store's folder {}", dir.display()))?;
        }
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(60))
            .foreign_keys(false);
        if path.exists() {
            check_schema(path, &opts).await?;
        }
        migrate(path, &opts)
            .await
            .with_context(|| format!("migrating the run store {}", path.display()))?;
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(opts.clone())
            .await
            .with_context(|| format!("opening the run store {}", path.display()))?;
        let mut conn = SqliteConnection::connect_with(&opts)
            .await
            .with_context(|| format!("opening the run store {}", path.display()))?;
        // What a process that could not write left in spill files; kept for later if the
        // store still refuses.
        match writer::replay_spills(&mut conn, path).await {
            Ok(0) => {}
            Ok(n) => tracing::info!("run store {}: {n} spilled rows written", path.display()),
            Err(e) => tracing::warn!(
                "run store {}: spills not replayed yet: {e:#}",
                path.display()
            ),
        }
        let id = store_id(&pool, path).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let health = SharedHealth::default();
        tokio::spawn(writer::writer(conn, rx, path.to_path_buf(), health.clone()));
        Ok(Store {
            pool,
            tx,
            path: path.to_path_buf(),
            health,
            read_only: false,
            id,
        })
    }

    /// Opens an existing store only to read it: nothing is created, migrated or written, so a
    /// store in a read-only folder or on a read-only disk can be listed and compared. A store
    /// from a newer harness is refused, naming both schema versions; one from an older harness
    /// is migrated first (which needs write access, and says so when it has none).
    pub async fn open_read_only(path: &Path) -> Result<Store> {
        Store::open_reader(path, true).await
    }

    /// Opens an existing store only to read it, as [`Store::open_read_only`], but never
    /// writes it in any way: a store from an older harness is refused (naming both schema
    /// versions) instead of migrated. What a viewer that promises not to touch the store
    /// opens (`harness ui`).
    pub async fn open_strictly_read_only(path: &Path) -> Result<Store> {
        Store::open_reader(path, false).await
    }

    async fn open_reader(path: &Path, migrate_older: bool) -> Result<Store> {
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(false)
            .read_only(true)
            .busy_timeout(Duration::from_secs(60))
            .foreign_keys(false);
        let (ours, theirs) = check_schema(path, &opts).await?;
        if theirs < ours && !migrate_older {
            bail!(
                "the run store {} is from an older harness (schema {theirs}, this one {ours}); \
                 it is opened read-only here, so it is not migrated: run `harness runs --db {}` \
                 once to migrate it",
                path.display(),
                path.display()
            );
        }
        if theirs < ours {
            return Store::open(path).await.with_context(|| {
                format!(
                    "the run store {} is from an older harness (schema {theirs}, this one \
                     {ours}) and must be migrated once by a process that can write it",
                    path.display()
                )
            });
        }
        // A WAL store whose -shm file is gone (its last writer closed) cannot be read in a
        // folder where that file cannot be made, unless SQLite is told nobody writes it.
        let pool = match SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(opts.clone())
            .await
        {
            Ok(pool) => pool,
            Err(_) => SqlitePoolOptions::new()
                .max_connections(4)
                .connect_with(opts.immutable(true))
                .await
                .with_context(|| format!("opening the run store {} to read", path.display()))?,
        };
        let id = store_id(&pool, path).await?;
        // No writer: a write is an error naming the store.
        let (tx, _) = mpsc::unbounded_channel();
        Ok(Store {
            pool,
            tx,
            path: path.to_path_buf(),
            health: SharedHealth::default(),
            read_only: true,
            id,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The store's identity (random, made with the store): run folders and checkpoints name
    /// it, so a checkpoint of another store's run is never taken for one of this store's.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Records the pids of a `--nproc-per-node` run's ranks, so that the run counts as alive
    /// while any of them is (see [`RunRow::effective_status`]).
    pub async fn set_rank_pids(&self, run: i64, pids: &[u32]) -> Result<()> {
        let pids = pids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" ");
        self.write(move |c| {
            Box::pin(async move {
                sqlx::query("UPDATE runs SET rank_pids = ? WHERE id = ?")
                    .bind(&pids)
                    .bind(run)
                    .execute(&mut *c)
                    .await?;
                Ok(0)
            })
        })
        .await
        .with_context(|| format!("recording the ranks of run {run}"))
        .map(drop)
    }

    /// The read pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn send(&self, op: Op) -> Result<()> {
        if self.read_only {
            bail!("the run store {} is open read-only", self.path.display());
        }
        self.tx
            .send(op)
            .map_err(|_| anyhow!("the run store's writer task has stopped"))
    }

    /// Queues one step's metrics (returns at once; the writer batches them).
    pub fn log_metrics<'a>(
        &self,
        run: i64,
        step: u64,
        metrics: impl IntoIterator<Item = (&'a String, &'a f64)>,
    ) -> Result<()> {
        let values: Vec<(String, f64)> =
            metrics.into_iter().map(|(k, v)| (k.clone(), *v)).collect();
        self.send(Op::Metrics {
            run,
            step: step as i64,
            wall: now(),
            values,
        })
    }

    /// Queues a heartbeat.
    pub fn heartbeat(&self, run: i64) -> Result<()> {
        self.send(Op::Heartbeat { run, time: now() })
    }

    /// Queues an event.
    pub fn event(&self, run: Option<i64>, kind: &str, message: impl Into<String>) -> Result<()> {
        self.send(Op::Event(QueuedEvent {
            run,
            time: now(),
            kind: kind.into(),
            message: message.into(),
        }))
    }

    /// Queues how run `run` ended, for when the transaction recording it failed: it is then
    /// owed like any metric (retried, spilled, replayed) instead of lost.
    pub fn end_owed(&self, run: i64, status: &str, error: Option<String>) -> Result<()> {
        self.send(Op::End(QueuedEnd {
            run,
            pid: i64::from(std::process::id()),
            status: status.into(),
            time: now(),
            error,
        }))
    }

    /// An error once the store has refused every write for longer than `patience_s` seconds:
    /// what failed, how many rows wait, and where spilled ones are kept.
    pub fn check(&self, patience_s: f64) -> Result<()> {
        let h = self.health.lock().unwrap_or_else(|e| e.into_inner());
        match h.failing_since {
            Some(since) if now() - since > patience_s => {
                let kept: Vec<String> = h.spilled.iter().map(|p| p.display().to_string()).collect();
                Err(anyhow!(
                    "the run store {} has refused every write for {:.0} s (trainer.store_patience_s = {patience_s}): {}; {} rows wait in memory{}",
                    self.path.display(),
                    now() - since,
                    h.error,
                    h.waiting,
                    if kept.is_empty() {
                        String::new()
                    } else {
                        format!(", more are kept in {}", kept.join(", "))
                    }
                ))
            }
            _ => Ok(()),
        }
    }

    /// Runs `f` in its own transaction on the writer, after everything queued before it.
    pub async fn write<F>(&self, f: F) -> Result<i64>
    where
        F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<i64>> + Send + 'static,
    {
        let (done, wait) = oneshot::channel();
        self.send(Op::Write(Box::new(f), done))?;
        wait.await
            .map_err(|_| anyhow!("the run store's writer task stopped during a write"))?
    }

    /// Waits until everything queued so far is committed.
    pub async fn flush(&self) -> Result<()> {
        let (done, wait) = oneshot::channel();
        self.send(Op::Flush(done))?;
        wait.await
            .map_err(|_| anyhow!("the run store's writer task stopped during a flush"))?
    }

    /// The run `spec` names: a run id, or the latest run with that name.
    pub async fn resolve_run(&self, spec: &str) -> Result<RunRow> {
        if let Ok(id) = spec.parse::<i64>() {
            return self
                .run(id)
                .await?
                .with_context(|| format!("no run {id} in {}", self.path.display()));
        }
        let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM runs WHERE name = ? ORDER BY id")
            .bind(spec)
            .fetch_all(&self.pool)
            .await?;
        let Some(&latest) = ids.last() else {
            let names: Vec<String> = sqlx::query_scalar("SELECT DISTINCT name FROM runs")
                .fetch_all(&self.pool)
                .await?;
            let hint = crate::suggest::nearest_key(spec, &names)
                .map(|n| format!("; did you mean `{n}`?"))
                .unwrap_or_default();
            bail!(
                "no run with id or name {spec:?} in {}{hint}",
                self.path.display()
            );
        };
        if ids.len() > 1 {
            let others: Vec<String> = ids[..ids.len() - 1].iter().map(i64::to_string).collect();
            note!(
                "harness: {spec:?} names {} runs; taking the latest, run {latest} (the others: {})",
                ids.len(),
                others.join(", ")
            );
        }
        self.run(latest)
            .await?
            .with_context(|| format!("run {latest} vanished from {}", self.path.display()))
    }

    /// The id of the sweep `spec` names: a sweep id, or a sweep name (`[sweep] name`) standing
    /// for its latest sweep; an error naming the nearest sweeps when there is none.
    pub async fn resolve_sweep(&self, spec: &str) -> Result<String> {
        let all: Vec<(String, String)> =
            sqlx::query_as("SELECT id, name FROM sweeps ORDER BY created DESC")
                .fetch_all(&self.pool)
                .await
                .context("reading the sweeps")?;
        if let Some((id, _)) = all.iter().find(|(id, name)| id == spec || name == spec) {
            return Ok(id.clone());
        }
        let names: Vec<String> = all
            .iter()
            .flat_map(|(id, name)| [name.clone(), id.clone()])
            .collect();
        let hint = match crate::suggest::nearest_key(spec, &names) {
            Some(n) => format!("; did you mean `{n}`?"),
            None if names.is_empty() => "; it has no sweeps".into(),
            None => format!(
                "; its sweeps: {}",
                all.iter()
                    .map(|(id, _)| id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        bail!("no sweep {spec:?} in {}{hint}", self.path.display())
    }

    /// One run, read on `c` (inside a write transaction, to decide on what it will change).
    pub async fn run_on(c: &mut SqliteConnection, id: i64) -> Result<Option<RunRow>> {
        let row = sqlx::query("SELECT * FROM runs WHERE id = ?")
            .bind(id)
            .fetch_optional(&mut *c)
            .await
            .with_context(|| format!("reading run {id}"))?;
        Ok(row.map(|r| RunRow::from_row(&r)))
    }

    /// One run.
    pub async fn run(&self, id: i64) -> Result<Option<RunRow>> {
        let row = sqlx::query("SELECT * FROM runs WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .with_context(|| format!("reading run {id}"))?;
        Ok(row.map(|r| RunRow::from_row(&r)))
    }

    /// All runs (optionally of one sweep), oldest first.
    pub async fn runs(&self, sweep: Option<&str>) -> Result<Vec<RunRow>> {
        let rows = match sweep {
            Some(s) => {
                sqlx::query("SELECT * FROM runs WHERE sweep_id = ? ORDER BY id")
                    .bind(s)
                    .fetch_all(&self.pool)
                    .await?
            }
            None => {
                sqlx::query("SELECT * FROM runs ORDER BY id")
                    .fetch_all(&self.pool)
                    .await?
            }
        };
        Ok(rows.iter().map(RunRow::from_row).collect())
    }

    /// The last value of every metric of a run: key → (step, value), the value the latest
    /// record at the largest step holds. A skip-scan of the `(run_id, key, step)` index: one
    /// seek per key to find the next key and one to its last step, so the cost grows with the
    /// number of keys, not of records (a run browser lists hundreds of long runs).
    pub async fn final_metrics(&self, run: i64) -> Result<BTreeMap<String, (i64, f64)>> {
        let rows = sqlx::query(
            "WITH RECURSIVE k(key) AS ( \
               SELECT (SELECT key FROM metrics WHERE run_id = ?1 ORDER BY key LIMIT 1) \
               UNION ALL \
               SELECT (SELECT key FROM metrics WHERE run_id = ?1 AND key > k.key \
                       ORDER BY key LIMIT 1) FROM k WHERE k.key IS NOT NULL) \
             SELECT m.key, m.step, m.value FROM k JOIN metrics m ON m.id = \
               (SELECT id FROM metrics WHERE run_id = ?1 AND key = k.key \
                ORDER BY step DESC, id DESC LIMIT 1)",
        )
        .bind(run)
        .fetch_all(&self.pool)
        .await
        .with_context(|| format!("reading the metrics of run {run}"))?;
        Ok(rows
            .iter()
            .map(|r| {
                let v: Option<f64> = r.get("value");
                (r.get("key"), (r.get("step"), v.unwrap_or(f64::NAN)))
            })
            .collect())
    }

    /// Per metric of `keys`, what a compare table shows, computed inside SQLite (aggregates
    /// over the `(run_id, key, step)` index instead of fetching every series): the last value, the largest and smallest values
    /// with their first step, and the last value at or before `at_step`. NaN (stored as NULL)
    /// counts as a value for `last` and `at` only.
    pub async fn summaries(
        &self,
        run: i64,
        keys: &[String],
        at_step: Option<i64>,
    ) -> Result<BTreeMap<String, MetricSummary>> {
        let mut out: BTreeMap<String, MetricSummary> = BTreeMap::new();
        if keys.is_empty() {
            return Ok(out);
        }
        let list = vec!["?"; keys.len()].join(", ");
        // SQLite's bare columns: with one MIN/MAX aggregate, `step` and `value` come from the
        // row that holds the extreme; on ties, the first row of the (run_id, key, step) index
        // scan, i.e. the earliest step.
        let picks = [
            "SELECT key, MAX(step), value FROM metrics WHERE run_id = ? AND key IN ({list}) GROUP BY key",
            "SELECT key, step, MAX(value) FROM metrics WHERE run_id = ? AND key IN ({list}) AND value IS NOT NULL GROUP BY key",
            "SELECT key, step, MIN(value) FROM metrics WHERE run_id = ? AND key IN ({list}) AND value IS NOT NULL GROUP BY key",
            "SELECT key, MAX(step), value FROM metrics WHERE run_id = ? AND key IN ({list}) AND step <= ? GROUP BY key",
        ];
        for (which, sql) in picks.iter().enumerate() {
            if which == 3 && at_step.is_none() {
                continue;
            }
            let sql = sql.replace("{list}", &list);
            // only placeholders are spliced in
            let mut q = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(run);
            for k in keys {
                q = q.bind(k);
            }
            if which == 3 {
                q = q.bind(at_step);
            }
            let rows = q
                .fetch_all(&self.pool)
                .await
                .with_context(|| format!("summarising the metrics of run {run}"))?;
            for r in rows {
                let key: String = r.get(0);
                let step: i64 = r.get(1);
                let value = r.get::<Option<f64>, _>(2).unwrap_or(f64::NAN);
                let e = out.entry(key).or_default();
                match which {
                    0 => e.last = Some((step, value)),
                    1 => e.max = Some((step, value)),
                    2 => e.min = Some((step, value)),
                    _ => e.at = Some(value),
                }
            }
        }
        Ok(out)
    }

    /// Every metric key a run recorded.
    pub async fn metric_keys(&self, run: i64) -> Result<Vec<String>> {
        sqlx::query_scalar("SELECT DISTINCT key FROM metrics WHERE run_id = ? ORDER BY key")
            .bind(run)
            .fetch_all(&self.pool)
            .await
            .with_context(|| format!("reading the metric keys of run {run}"))
    }

    /// One metric's history: (step, value), by step.
    pub async fn series(&self, run: i64, key: &str) -> Result<Vec<(i64, f64)>> {
        Ok(self
            .series_timed(run, key)
            .await?
            .into_iter()
            .map(|(step, _, v)| (step, v))
            .collect())
    }

    /// One metric's history with the wall-clock time of each record: (step, Unix seconds,
    /// value), by step.
    pub async fn series_timed(&self, run: i64, key: &str) -> Result<Vec<(i64, f64, f64)>> {
        let rows = sqlx::query(
            "SELECT step, wall_time, value FROM metrics WHERE run_id = ? AND key = ? \
             ORDER BY step, id",
        )
        .bind(run)
        .bind(key)
        .fetch_all(&self.pool)
        .await
        .with_context(|| format!("reading metric {key} of run {run}"))?;
        Ok(rows
            .iter()
            .map(|r| {
                let v: Option<f64> = r.get(2);
                (r.get(0), r.get(1), v.unwrap_or(f64::NAN))
            })
            .collect())
    }

    /// Every metric row of a run: (step, key, value, wall_time), by step then key.
    pub async fn all_metrics(&self, run: i64) -> Result<Vec<(i64, String, f64, f64)>> {
        let rows = sqlx::query(
            "SELECT step, key, value, wall_time FROM metrics WHERE run_id = ? ORDER BY step, key, id",
        )
        .bind(run)
        .fetch_all(&self.pool)
        .await
        .with_context(|| format!("reading the metrics of run {run}"))?;
        Ok(rows
            .iter()
            .map(|r| {
                let v: Option<f64> = r.get(2);
                (r.get(0), r.get(1), v.unwrap_or(f64::NAN), r.get(3))
            })
            .collect())
    }

    /// The recorded checkpoints of a run, by step.
    pub async fn checkpoints(&self, run: i64) -> Result<Vec<CheckpointRow>> {
        let rows = sqlx::query(
            "SELECT step, path, created, manifest FROM checkpoints WHERE run_id = ? ORDER BY step",
        )
        .bind(run)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| CheckpointRow {
                step: r.get(0),
                path: r.get(1),
                created: r.get(2),
                manifest: r.get(3),
            })
            .collect())
    }

    /// Inserts validation generations of run `run` at `step`, on `c` (inside the caller's write
    /// transaction, which may record more with them: the tracker's outbox record).
    pub async fn insert_generations(
        c: &mut SqliteConnection,
        run: i64,
        step: u64,
        rows: &[GenerationRow],
    ) -> Result<()> {
        for g in rows {
            sqlx::query(
                "INSERT INTO generations (run_id, step, data_source, prompt, response, score) \
                 VALUES (?, ?, ?, ?, ?, ?)",
            )
            .bind(run)
            .bind(step as i64)
            .bind(&g.data_source)
            .bind(&g.prompt)
            .bind(&g.response)
            .bind(g.score.is_finite().then_some(g.score))
            .execute(&mut *c)
            .await
            .with_context(|| {
                format!("recording the validation generations of run {run} at step {step}")
            })?;
        }
        Ok(())
    }

    /// The validation generations of a run, by step, in the order recorded.
    pub async fn generations(&self, run: i64) -> Result<Vec<GenerationRow>> {
        let rows = sqlx::query(
            "SELECT step, data_source, prompt, response, score FROM generations \
             WHERE run_id = ? ORDER BY step, id",
        )
        .bind(run)
        .fetch_all(&self.pool)
        .await
        .with_context(|| format!("reading the generations of run {run}"))?;
        Ok(rows
            .iter()
            .map(|r| GenerationRow {
                step: r.get(0),
                data_source: r.get(1),
                prompt: r.get(2),
                response: r.get(3),
                score: r.get::<Option<f64>, _>(4).unwrap_or(f64::NAN),
            })
            .collect())
    }

    /// The events of a run, oldest first.
    pub async fn events(&self, run: i64) -> Result<Vec<EventRow>> {
        let rows =
            sqlx::query("SELECT time, kind, message FROM events WHERE run_id = ? ORDER BY id")
                .bind(run)
                .fetch_all(&self.pool)
                .await?;
        Ok(rows
            .iter()
            .map(|r| EventRow {
                time: r.get(0),
                kind: r.get(1),
                message: r.get(2),
            })
            .collect())
    }
}

/// The store's identity from `store_meta`.
async fn store_id(pool: &SqlitePool, path: &Path) -> Result<String> {
    sqlx::query_scalar("SELECT value FROM store_meta WHERE key = 'store_id'")
        .fetch_one(pool)
        .await
        .with_context(|| format!("reading the identity of the run store {}", path.display()))
}

/// The migrations this harness knows.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The newest schema version this harness knows and the store's; an error if the store is
/// newer (written by a newer harness, whose tables this one would misread).
async fn check_schema(path: &Path, opts: &SqliteConnectOptions) -> Result<(i64, i64)> {
    let ours = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    let ro = opts.clone().read_only(true);
    let mut conn = match SqliteConnection::connect_with(&ro).await {
        Ok(c) => c,
        Err(_) => SqliteConnection::connect_with(&ro.immutable(true))
            .await
            .with_context(|| format!("opening the run store {}", path.display()))?,
    };
    let read = async {
        let tracked: Option<String> = sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
        )
        .fetch_optional(&mut conn)
        .await?;
        if tracked.is_none() {
            // a new, empty file
            return Ok::<_, sqlx::Error>(None);
        }
        sqlx::query_scalar("SELECT MAX(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(&mut conn)
            .await
    }
    .await;
    conn.close().await.ok();
    let theirs: i64 = read
        .with_context(|| {
            format!(
                "reading the schema version of the run store {}",
                path.display()
            )
        })?
        .unwrap_or(0);
    if theirs > ours {
        bail!(
            "the run store {} was written by a newer harness (schema {theirs}; this harness \
             knows up to {ours}): use that harness, or a newer one",
            path.display()
        );
    }
    Ok((ours, theirs))
}

/// Applies the checked-in migrations, holding an exclusive lock on `<db>.migrate.lock` so two
/// processes opening a new store at once cannot race.
async fn migrate(path: &Path, opts: &SqliteConnectOptions) -> Result<()> {
    let lock_path = PathBuf::from(format!("{}.migrate.lock", path.display()));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("opening {}", lock_path.display()))?;
    let lock = tokio::task::spawn_blocking(move || lock.lock().map(|()| lock))
        .await?
        .with_context(|| format!("locking {}", lock_path.display()))?;
    let mut conn = SqliteConnection::connect_with(opts).await?;
    let result = MIGRATOR.run(&mut conn).await;
    conn.close().await.ok();
    drop(lock);
    result.map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The skip-scan of `final_metrics` finds every key and, per key, the value of the latest
    /// record at its largest step: a step recorded twice (a resume that rewinds) gives the later
    /// record, a NaN stays NaN, and each run sees only its own records.
    #[test]
    fn final_metrics_takes_the_latest_record_at_each_keys_last_step() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        rt.block_on(async {
            let store = Store::open(&dir.path().join("harness.db")).await.unwrap();
            let mut runs = Vec::new();
            for name in ["a", "b"] {
                let id = store
                    .write(move |c| {
                        Box::pin(async move {
                            Ok(sqlx::query_scalar(
                                "INSERT INTO runs (name, project, status, config, host, seed, \
                                 run_dir, created, heartbeat_s) \
                                 VALUES (?, 'p', 'finished', '{}', 'h', 0, '', 0, 5) RETURNING id",
                            )
                            .bind(name)
                            .fetch_one(&mut *c)
                            .await?)
                        })
                    })
                    .await
                    .unwrap();
                runs.push(id);
            }
            let log = |run: i64, step: u64, m: &[(&str, f64)]| {
                let m: Vec<(String, f64)> = m.iter().map(|(k, v)| (k.to_string(), *v)).collect();
                store
                    .log_metrics(run, step, m.iter().map(|(k, v)| (k, v)))
                    .unwrap();
            };
            log(runs[0], 0, &[("loss", 3.0), ("score", 0.1), ("x/y", 1.0)]);
            log(runs[0], 1, &[("loss", 2.0), ("score", 0.2)]);
            log(runs[0], 1, &[("loss", 1.5)]);
            log(runs[0], 2, &[("score", f64::NAN)]);
            log(runs[1], 5, &[("other", 7.0)]);
            store.flush().await.unwrap();
            let got = store.final_metrics(runs[0]).await.unwrap();
            assert_eq!(got.keys().collect::<Vec<_>>(), ["loss", "score", "x/y"]);
            assert_eq!(got["loss"], (1, 1.5));
            assert_eq!(got["score"].0, 2);
            assert!(got["score"].1.is_nan());
            assert_eq!(got["x/y"], (0, 1.0));
            let other = store.final_metrics(runs[1]).await.unwrap();
            assert_eq!(
                other.into_iter().collect::<Vec<_>>(),
                [("other".to_string(), (5, 7.0))]
            );
            let none = store.final_metrics(99).await.unwrap();
            assert!(none.is_empty());
        });
    }
}
