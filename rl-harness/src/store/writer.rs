//! The run store's one writer task.
//!
//! Metrics, heartbeats, events and run ends are queued by the training loop and written in
//! batches. A batch SQLite refuses (the write lock held too long by another process, a full
//! disk, an I/O error) is kept, in order, and retried with backoff while new rows join it;
//! nothing queued is ever dropped. When a flush cannot write what is owed, or the backlog
//! outgrows [`SPILL_ROWS`], it is spilled to a file of its own beside the store (or, when that
//! disk is the full one, in the temp folder): [`spill_files`] names them. The next writer of
//! the store (this process once the store takes writes again, or whoever opens it next) replays
//! each spill exactly once: its id is recorded in `replayed_spills` in the transaction that
//! writes its rows. [`Health`] tells the training loop for how long the store has refused
//! writes, so that a run fails loudly instead of training on while nothing is recorded.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::SqliteConnection;
use sqlx::{Connection, QueryBuilder, Sqlite};
use tokio::sync::{mpsc, oneshot};

use super::{WriteFn, now, pid_alive};

/// Rows of metrics per INSERT statement (5 binds each, well under SQLite's bind limit).
const ROWS_PER_INSERT: usize = 150;
/// A backlog larger than this many rows is spilled to a file instead of growing in memory.
pub(super) const SPILL_ROWS: usize = 200_000;
/// The first wait before a refused batch is tried again; doubled up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub(super) enum Op {
    Metrics {
        run: i64,
        step: i64,
        wall: f64,
        values: Vec<(String, f64)>,
    },
    Heartbeat {
        run: i64,
        time: f64,
    },
    Event(QueuedEvent),
    /// How a run ended, when the transaction that records it failed: kept like any other row.
    End(QueuedEnd),
    Write(WriteFn, oneshot::Sender<Result<i64>>),
    Flush(oneshot::Sender<Result<()>>),
}

/// One metric value; `None` is NaN (SQLite stores NaN as NULL, JSON has no NaN).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct MetricRow {
    run: i64,
    step: i64,
    key: String,
    value: Option<f64>,
    wall: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct QueuedEvent {
    pub(super) run: Option<i64>,
    pub(super) time: f64,
    pub(super) kind: String,
    pub(super) message: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct QueuedEnd {
    pub(super) run: i64,
    /// The process that drove the run: a replay never ends a run another process took over.
    pub(super) pid: i64,
    pub(super) status: String,
    pub(super) time: f64,
    pub(super) error: Option<String>,
}

/// What is owed to the store, in the order it came.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Backlog {
    metrics: Vec<MetricRow>,
    heartbeats: BTreeMap<i64, f64>,
    events: Vec<QueuedEvent>,
    ends: Vec<QueuedEnd>,
}

impl Backlog {
    fn push(&mut self, op: Op) {
        match op {
            Op::Metrics {
                run,
                step,
                wall,
                values,
            } => self
                .metrics
                .extend(values.into_iter().map(|(key, v)| MetricRow {
                    run,
                    step,
                    key,
                    value: (!v.is_nan()).then_some(v),
                    wall,
                })),
            Op::Heartbeat { run, time } => {
                self.heartbeats.insert(run, time);
            }
            Op::Event(e) => self.events.push(e),
            Op::End(e) => self.ends.push(e),
            Op::Write(..) | Op::Flush(_) => {}
        }
    }

    fn rows(&self) -> usize {
        self.metrics.len() + self.heartbeats.len() + self.events.len() + self.ends.len()
    }

    fn is_empty(&self) -> bool {
        self.rows() == 0
    }
}

/// Whether the store takes writes; shared between the writer and every [`super::Store`] clone.
#[derive(Debug, Default)]
pub(super) struct Health {
    /// Since when (Unix seconds) every attempt failed.
    pub(super) failing_since: Option<f64>,
    /// The last failure.
    pub(super) error: String,
    /// Rows waiting in memory.
    pub(super) waiting: usize,
    /// Spill files this process wrote that are not replayed yet.
    pub(super) spilled: Vec<PathBuf>,
}

pub(super) type SharedHealth = Arc<Mutex<Health>>;

fn lock(h: &SharedHealth) -> std::sync::MutexGuard<'_, Health> {
    h.lock().unwrap_or_else(|e| e.into_inner())
}

/// The writer task: runs until every [`super::Store`] clone is dropped.
pub(super) async fn writer(
    mut conn: SqliteConnection,
    mut rx: mpsc::UnboundedReceiver<Op>,
    db: PathBuf,
    health: SharedHealth,
) {
    let mut backlog = Backlog::default();
    let mut backoff = MIN_BACKOFF;
    let mut open = true;
    while open || !backlog.is_empty() {
        let mut ops = Vec::new();
        if backlog.is_empty() {
            match rx.recv().await {
                Some(op) => ops.push(op),
                None => break,
            }
        } else if open {
            // Owed rows: wake for new ops or when it is time to try again.
            match tokio::time::timeout(backoff, rx.recv()).await {
                Ok(Some(op)) => ops.push(op),
                Ok(None) => open = false,
                Err(_) => {}
            }
        } else {
            // Every handle is gone and the store still refuses: keep the rows in a file.
            if let Err(e) = spill(&db, &mut backlog, &health) {
                tracing::error!("run store {}: {e:#}", db.display());
            }
            break;
        }
        while ops.len() < 4096 {
            match rx.try_recv() {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        for op in ops {
            match op {
                Op::Write(f, done) => {
                    // What came before it is written first (one attempt; it stays owed if not).
                    settle(&mut conn, &db, &mut backlog, &health).await;
                    let _ = done.send(transaction(&mut conn, f).await);
                }
                Op::Flush(done) => {
                    let r = if settle(&mut conn, &db, &mut backlog, &health).await {
                        Ok(())
                    } else {
                        let cause = lock(&health).error.clone();
                        match spill(&db, &mut backlog, &health) {
                            Ok(Some(file)) => Err(anyhow!(
                                "the run store {} refuses writes ({cause}); the rows it owes are \
                                 kept in {} and written when it takes writes again",
                                db.display(),
                                file.display()
                            )),
                            Ok(None) => Ok(()),
                            Err(e) => Err(e.context(format!(
                                "the run store {} refuses writes ({cause})",
                                db.display()
                            ))),
                        }
                    };
                    let _ = done.send(r);
                }
                other => backlog.push(other),
            }
        }
        if settle(&mut conn, &db, &mut backlog, &health).await {
            backoff = MIN_BACKOFF;
        } else {
            backoff = (backoff * 2).min(MAX_BACKOFF);
            if backlog.rows() > SPILL_ROWS
                && let Err(e) = spill(&db, &mut backlog, &health)
            {
                tracing::error!("run store {}: {e:#}", db.display());
            }
        }
    }
    conn.close().await.ok();
}

/// Tries once to write the backlog (and, once the store takes writes, this process's spills).
/// Returns whether nothing is owed any more.
async fn settle(
    conn: &mut SqliteConnection,
    db: &Path,
    backlog: &mut Backlog,
    health: &SharedHealth,
) -> bool {
    let result = match commit(conn, backlog, None).await {
        Ok(()) => {
            *backlog = Backlog::default();
            let spilled = std::mem::take(&mut lock(health).spilled);
            let replayed = replay_files(conn, &spilled).await.map(|_| ());
            if replayed.is_err() {
                lock(health).spilled.extend(spilled);
            }
            replayed
        }
        Err(e) => Err(e),
    };
    let mut h = lock(health);
    h.waiting = backlog.rows();
    match result {
        Ok(()) => {
            if h.failing_since.take().is_some() {
                tracing::info!("run store {}: takes writes again", db.display());
            }
            true
        }
        Err(e) => {
            let first = h.failing_since.is_none();
            h.failing_since.get_or_insert_with(now);
            h.error = format!("{e:#}");
            if first {
                tracing::warn!(
                    "run store {}: a write failed, {} rows kept and retried: {e:#}",
                    db.display(),
                    h.waiting
                );
            }
            false
        }
    }
}

/// Writes `b` in one transaction; with `spill`, also records that spill as replayed (and writes
/// nothing if it already was).
async fn commit(conn: &mut SqliteConnection, b: &Backlog, spill: Option<&str>) -> Result<()> {
    if b.is_empty() && spill.is_none() {
        return Ok(());
    }
    sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await?;
    match apply(conn, b, spill).await {
        Ok(()) => {
            if let Err(e) = sqlx::query("COMMIT").execute(&mut *conn).await {
                sqlx::query("ROLLBACK").execute(&mut *conn).await.ok();
                return Err(e.into());
            }
            Ok(())
        }
        Err(e) => {
            sqlx::query("ROLLBACK").execute(&mut *conn).await.ok();
            Err(e)
        }
    }
}

async fn apply(conn: &mut SqliteConnection, b: &Backlog, spill: Option<&str>) -> Result<()> {
    if let Some(id) = spill {
        let done = sqlx::query("INSERT OR IGNORE INTO replayed_spills (id, time) VALUES (?, ?)")
            .bind(id)
            .bind(now())
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() == 0 {
            return Ok(());
        }
    }
    for chunk in b.metrics.chunks(ROWS_PER_INSERT) {
        let mut qb: QueryBuilder<Sqlite> =
            QueryBuilder::new("INSERT INTO metrics (run_id, step, key, value, wall_time) ");
        qb.push_values(chunk, |mut q, r| {
            q.push_bind(r.run)
                .push_bind(r.step)
                .push_bind(r.key.clone())
                .push_bind(r.value)
                .push_bind(r.wall);
        });
        qb.build().persistent(true).execute(&mut *conn).await?;
    }
    for (run, time) in &b.heartbeats {
        sqlx::query("UPDATE runs SET heartbeat = MAX(COALESCE(heartbeat, 0), ?) WHERE id = ?")
            .bind(time)
            .bind(run)
            .execute(&mut *conn)
            .await?;
    }
    for e in &b.events {
        sqlx::query("INSERT INTO events (run_id, time, kind, message) VALUES (?, ?, ?, ?)")
            .bind(e.run)
            .bind(e.time)
            .bind(&e.kind)
            .bind(&e.message)
            .execute(&mut *conn)
            .await?;
    }
    for e in &b.ends {
        sqlx::query(
            "UPDATE runs SET status = ?, ended = ?, heartbeat = ?, error = ? \
             WHERE id = ? AND status = 'running' AND pid = ?",
        )
        .bind(&e.status)
        .bind(e.time)
        .bind(e.time)
        .bind(&e.error)
        .bind(e.run)
        .bind(e.pid)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// Runs `f` in its own `BEGIN IMMEDIATE` transaction.
pub(super) async fn transaction(conn: &mut SqliteConnection, f: WriteFn) -> Result<i64> {
    sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await?;
    match f(conn).await {
        Ok(v) => {
            // A failed COMMIT (a full disk) may leave the transaction open, holding the lock.
            if let Err(e) = sqlx::query("COMMIT").execute(&mut *conn).await {
                sqlx::query("ROLLBACK").execute(&mut *conn).await.ok();
                return Err(e.into());
            }
            Ok(v)
        }
        Err(e) => {
            sqlx::query("ROLLBACK").execute(&mut *conn).await.ok();
            Err(e)
        }
    }
}

/// One spill: an id (recorded when replayed) and the rows.
#[derive(Serialize, Deserialize)]
struct Spill {
    id: String,
    rows: Backlog,
}

/// A stable short name of the store, for spill files in the temp folder.
fn store_tag(db: &Path) -> String {
    let canonical = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_path_buf());
    let mut h: u64 = 0xcbf29ce484222325;
    for b in canonical.to_string_lossy().bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// Where `pid`'s spills of store `db` go: beside the store first, the temp folder second.
fn spill_paths(db: &Path, pid: u32) -> [PathBuf; 2] {
    let name = db
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "store".into());
    [
        db.with_file_name(format!("{name}.unwritten.{pid}.jsonl")),
        std::env::temp_dir().join(format!("harness-unwritten-{}.{pid}.jsonl", store_tag(db))),
    ]
}

/// Every spill file of store `db`, with the pid that wrote it.
pub(super) fn spill_files(db: &Path) -> Vec<(PathBuf, u32)> {
    let name = db
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "store".into());
    let beside = db.parent().filter(|p| !p.as_os_str().is_empty());
    let places = [
        (
            beside.unwrap_or(Path::new(".")).to_path_buf(),
            format!("{name}.unwritten."),
        ),
        (
            std::env::temp_dir(),
            format!("harness-unwritten-{}.", store_tag(db)),
        ),
    ];
    let mut out = Vec::new();
    for (dir, prefix) in places {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = file
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix(".jsonl"))
                .and_then(|pid| pid.parse().ok())
            {
                out.push((e.path(), pid));
            }
        }
    }
    out.sort();
    out
}

/// Appends the backlog to this process's spill file (synced) and empties it; `None` when there
/// was nothing to keep.
fn spill(db: &Path, backlog: &mut Backlog, health: &SharedHealth) -> Result<Option<PathBuf>> {
    if backlog.is_empty() {
        return Ok(None);
    }
    let spill = Spill {
        id: format!("{}-{:016x}", std::process::id(), rand::random::<u64>()),
        rows: std::mem::take(backlog),
    };
    let line = serde_json::to_string(&spill)? + "\n";
    let mut failures = Vec::new();
    for path in spill_paths(db, std::process::id()) {
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| {
                let before = f.metadata()?.len();
                let r = f.write_all(line.as_bytes()).and_then(|()| f.sync_data());
                if r.is_err() {
                    // No torn line for the next spill to be glued to.
                    let _ = f.set_len(before);
                }
                r
            });
        match written {
            Ok(()) => {
                let mut h = lock(health);
                if !h.spilled.contains(&path) {
                    h.spilled.push(path.clone());
                }
                h.waiting = 0;
                tracing::warn!(
                    "run store {}: {} rows it refused are kept in {}",
                    db.display(),
                    spill.rows.rows(),
                    path.display()
                );
                return Ok(Some(path));
            }
            Err(e) => failures.push(format!("{}: {e}", path.display())),
        }
    }
    // Nowhere to keep them: they stay in memory, owed.
    let n = spill.rows.rows();
    *backlog = spill.rows;
    Err(anyhow!(
        "{n} rows could be neither written nor kept in a file ({})",
        failures.join("; ")
    ))
}

/// Replays the spill files of `db` left by processes that are gone (and this one's); returns
/// how many rows were written. A file is removed once all of it is in the store.
pub(super) async fn replay_spills(conn: &mut SqliteConnection, db: &Path) -> Result<usize> {
    let me = std::process::id();
    let files: Vec<PathBuf> = spill_files(db)
        .into_iter()
        .filter(|(_, pid)| *pid == me || !pid_alive(i64::from(*pid)))
        .map(|(path, _)| path)
        .collect();
    replay_files(conn, &files).await
}

async fn replay_files(conn: &mut SqliteConnection, files: &[PathBuf]) -> Result<usize> {
    let mut rows = 0;
    for path in files {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        for (i, line) in text.lines().enumerate() {
            // A line cut short by a crash while it was written was never acknowledged.
            let Ok(spill) = serde_json::from_str::<Spill>(line) else {
                tracing::warn!("{}:{}: not a whole spill, skipped", path.display(), i + 1);
                continue;
            };
            commit(conn, &spill.rows, Some(&spill.id))
                .await
                .with_context(|| format!("replaying {}:{}", path.display(), i + 1))?;
            rows += spill.rows.rows();
        }
        std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
        tracing::info!("replayed {} into the run store; removed it", path.display());
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backlog_keeps_nan_heartbeats_and_order_through_json() {
        let mut b = Backlog::default();
        b.push(Op::Metrics {
            run: 1,
            step: 3,
            wall: 10.0,
            values: vec![("a".into(), f64::NAN), ("b".into(), 2.5)],
        });
        b.push(Op::Heartbeat { run: 1, time: 11.0 });
        b.push(Op::Heartbeat { run: 1, time: 12.0 });
        let back: Backlog = serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(back.metrics.len(), 2);
        assert_eq!(back.metrics[0].value, None);
        assert_eq!(back.metrics[1].value, Some(2.5));
        assert_eq!(back.heartbeats[&1], 12.0);
        assert_eq!(back.rows(), 3);
    }
}
