//! The remote tracker: mirrors runs, params and metrics to an MLflow-compatible REST server
//! (`experiments/get-by-name|create`, `runs/create`, `runs/log-batch`, `runs/update`), and each
//! validation's kept generations (`trainer.log_val_generations`) as the run's artifact
//! `val_generations/step_NNNNNN.json`, through the server's artifact proxy.
//!
//! SQLite stays the source of truth. Run creation, params and status changes are written to the
//! `outbox` table in the same transaction as the change itself; metrics are pushed by rowid past
//! each run's cursor in `tracker_runs`. A background task pushes while training; a tracker that
//! is down or slow only leaves records pending (never blocks or fails training), and
//! `harness sync` pushes them later.
//!
//! Every push is idempotent, so nothing is doubled remotely when an answer is lost (a timeout
//! after the server acted, a kill between a call and its record): a run is created with a
//! random `harness.create_token` tag and looked up by it before creating again; params are
//! diffed against the remote run's; a metrics batch is recorded as in flight before it is
//! posted, and an in-flight batch is looked up remotely before it is sent again. One process at
//! a time pushes a run: it holds a lease (`tracker_runs.sync_owner`, `sync_until`).

mod mlflow;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use serde_json::{Value, json};
use sqlx::Row;
use sqlx::sqlite::SqliteConnection;
use tokio::runtime::Runtime;
use tokio::sync::watch;

use crate::config::{self, ExperimentConfig, TrackerConfig};
use crate::store::{Store, now};
use mlflow::{CallError, MlflowClient, metric_value};

/// MLflow's limits for one `runs/log-batch` call.
pub const MAX_METRICS_PER_BATCH: usize = 1000;
/// MLflow's limit of params per `runs/log-batch` call.
pub const MAX_PARAMS_PER_BATCH: usize = 100;
/// The tag that finds a remote run again when the answer to its `runs/create` was lost.
const CREATE_TOKEN: &str = "harness.create_token";
/// MLflow's limit on a param value's length.
const MAX_PARAM_VALUE: usize = 6000;

/// Records a new run's `create` and `params` in the outbox (inside the caller's transaction).
pub async fn enqueue_start(
    c: &mut SqliteConnection,
    run_id: i64,
    cfg: &ExperimentConfig,
) -> Result<()> {
    let t = now();
    sqlx::query(
        "INSERT INTO tracker_runs (run_id, uri, metric_cursor) VALUES (?, ?, 0) \
         ON CONFLICT (run_id) DO UPDATE SET uri = excluded.uri, metric_cursor = 0, \
         remote_run_id = NULL, experiment_id = NULL, inflight_upto = NULL, \
         sync_owner = NULL, sync_until = NULL",
    )
    .bind(run_id)
    .bind(&cfg.trainer.tracker.uri)
    .execute(&mut *c)
    .await?;
    let experiment = cfg
        .trainer
        .tracker
        .experiment
        .clone()
        .unwrap_or_else(|| cfg.trainer.project_name.clone());
    let create = json!({
        "experiment": experiment,
        "run_name": format!("{}-{run_id}", cfg.trainer.experiment_name),
        "start_time": (t * 1000.0) as i64,
        "tags": {
            "harness.run_id": run_id.to_string(),
            "mlflow.runName": format!("{}-{run_id}", cfg.trainer.experiment_name),
            CREATE_TOKEN: format!("{:032x}", rand::random::<u128>()),
        },
    });
    let flat = config::flatten(&serde_json::to_value(cfg)?);
    let params: Vec<(String, String)> = flat
        .into_iter()
        .map(|(k, v)| {
            let s = match v {
                Value::String(s) => s,
                other => other.to_string(),
            };
            (k, s.chars().take(MAX_PARAM_VALUE).collect())
        })
        .collect();
    for (kind, payload) in [
        ("create", create),
        ("params", serde_json::to_value(params)?),
    ] {
        outbox(c, run_id, kind, &payload).await?;
    }
    Ok(())
}

/// On resume, after the store dropped the metrics past `step`: a run that already exists
/// remotely is replaced there, since MLflow cannot delete single metric values. The old remote
/// run is deleted (MLflow keeps it in its trash) and a fresh one is created, to which the params
/// and every remaining metric are pushed again, so the remote mirror holds exactly what the
/// store holds. Returns whether a replacement was queued (inside the caller's transaction).
pub async fn enqueue_rewind(
    c: &mut SqliteConnection,
    run_id: i64,
    step: i64,
    cfg: &ExperimentConfig,
) -> Result<bool> {
    let remote: Option<Option<String>> =
        sqlx::query_scalar("SELECT remote_run_id FROM tracker_runs WHERE run_id = ?")
            .bind(run_id)
            .fetch_optional(&mut *c)
            .await?;
    // Not created remotely yet: no metric was pushed, nothing to take back.
    let Some(Some(old)) = remote else {
        return Ok(false);
    };
    outbox(
        c,
        run_id,
        "rewind",
        &json!({"remote_run_id": old, "step": step}),
    )
    .await?;
    // a fresh remote run, metrics pushed from the first one on, and the validation
    // generations kept (the caller dropped those past `step`)
    enqueue_start(c, run_id, cfg).await?;
    let steps: Vec<i64> =
        sqlx::query_scalar("SELECT DISTINCT step FROM generations WHERE run_id = ? ORDER BY step")
            .bind(run_id)
            .fetch_all(&mut *c)
            .await?;
    for s in steps {
        enqueue_generations(c, run_id, s).await?;
    }
    Ok(true)
}

/// Records in the outbox that run `run_id`'s validation generations at `step` (already in the
/// store, in the caller's transaction) go to the remote run, as the artifact
/// `val_generations/step_NNNNNN.json`; nothing for a run that is not tracked.
pub async fn enqueue_generations(c: &mut SqliteConnection, run_id: i64, step: i64) -> Result<()> {
    if !is_tracked(c, run_id).await? {
        return Ok(());
    }
    let rows: Vec<Value> = sqlx::query(
        "SELECT data_source, prompt, response, score FROM generations \
         WHERE run_id = ? AND step = ? ORDER BY id",
    )
    .bind(run_id)
    .bind(step)
    .fetch_all(&mut *c)
    .await?
    .iter()
    .map(|r| {
        json!({
            "data_source": r.get::<String, _>(0),
            "prompt": r.get::<String, _>(1),
            "response": r.get::<String, _>(2),
            "score": r.get::<Option<f64>, _>(3),
        })
    })
    .collect();
    outbox(
        c,
        run_id,
        "generations",
        &json!({"step": step, "rows": rows}),
    )
    .await
}

/// Adds a record of `kind` for run `run_id` to the outbox (inside the caller's transaction).
async fn outbox(c: &mut SqliteConnection, run_id: i64, kind: &str, payload: &Value) -> Result<()> {
    sqlx::query("INSERT INTO outbox (run_id, kind, payload, created) VALUES (?, ?, ?, ?)")
        .bind(run_id)
        .bind(kind)
        .bind(payload.to_string())
        .bind(now())
        .execute(&mut *c)
        .await?;
    Ok(())
}

/// Whether run `run_id` is mirrored to a tracker.
async fn is_tracked(c: &mut SqliteConnection, run_id: i64) -> Result<bool> {
    let tracked: Option<i64> =
        sqlx::query_scalar("SELECT run_id FROM tracker_runs WHERE run_id = ?")
            .bind(run_id)
            .fetch_optional(&mut *c)
            .await?;
    Ok(tracked.is_some())
}

/// Records a status change in the outbox, for runs that are tracked.
pub async fn enqueue_status(
    c: &mut SqliteConnection,
    run_id: i64,
    status: &str,
    end_time: Option<f64>,
) -> Result<()> {
    if !is_tracked(c, run_id).await? {
        return Ok(());
    }
    let mlflow = match status {
        "running" => "RUNNING",
        "finished" => "FINISHED",
        "failed" => "FAILED",
        _ => "KILLED",
    };
    let payload = json!({"status": mlflow, "end_time": end_time.map(|t| (t * 1000.0) as i64)});
    outbox(c, run_id, "status", &payload).await
}

/// What is still waiting for the tracker for one run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pending {
    /// Outbox records not yet accepted.
    pub records: i64,
    /// Metric rows not yet pushed.
    pub metrics: i64,
}

impl Pending {
    /// Nothing left.
    pub fn is_empty(&self) -> bool {
        self.total() == 0
    }

    /// Records and metric rows left, together.
    fn total(&self) -> i64 {
        self.records + self.metrics
    }
}

/// What is pending for `run_id`.
pub async fn pending(store: &Store, run_id: i64) -> Result<Pending> {
    let records: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM outbox WHERE run_id = ? AND done IS NULL")
            .bind(run_id)
            .fetch_one(store.pool())
            .await?;
    let metrics: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM metrics m JOIN tracker_runs t ON t.run_id = m.run_id \
         WHERE m.run_id = ? AND m.id > t.metric_cursor",
    )
    .bind(run_id)
    .fetch_one(store.pool())
    .await?;
    Ok(Pending { records, metrics })
}

async fn mark(store: &Store, outbox_id: i64, done: bool, error: Option<String>) -> Result<()> {
    store
        .write(move |c| {
            Box::pin(async move {
                sqlx::query(
                    "UPDATE outbox SET attempts = attempts + 1, last_error = ?, done = CASE WHEN ? THEN ? ELSE NULL END WHERE id = ?",
                )
                .bind(error)
                .bind(done)
                .bind(now())
                .bind(outbox_id)
                .execute(&mut *c)
                .await?;
                Ok(0)
            })
        })
        .await
        .map(|_| ())
}

/// This process's name as the holder of a run's push lease.
fn owner() -> &'static str {
    static OWNER: OnceLock<String> = OnceLock::new();
    OWNER.get_or_init(|| {
        format!(
            "pid {} ({:016x})",
            std::process::id(),
            rand::random::<u64>()
        )
    })
}

/// Takes the push lease of `run_id` until `until` (Unix seconds), or names who holds it.
async fn claim(store: &Store, run_id: i64, until: f64) -> Result<Option<String>> {
    let me = owner();
    let claimed = store
        .write(move |c| {
            Box::pin(async move {
                let r = sqlx::query(
                    "UPDATE tracker_runs SET sync_owner = ?1, sync_until = ?2 WHERE run_id = ?3 \
                     AND (sync_owner IS NULL OR sync_owner = ?1 OR sync_until < ?4)",
                )
                .bind(me)
                .bind(until)
                .bind(run_id)
                .bind(now())
                .execute(&mut *c)
                .await?;
                Ok(r.rows_affected() as i64)
            })
        })
        .await?;
    if claimed == 1 {
        return Ok(None);
    }
    let holder: Option<(Option<String>, Option<f64>)> =
        sqlx::query_as("SELECT sync_owner, sync_until FROM tracker_runs WHERE run_id = ?")
            .bind(run_id)
            .fetch_optional(store.pool())
            .await?;
    Ok(Some(match holder {
        Some((Some(who), Some(until))) => {
            format!("{who}, for {:.0} s more", (until - now()).max(0.0))
        }
        _ => "another process".to_owned(),
    }))
}

async fn release(store: &Store, run_id: i64) -> Result<()> {
    let me = owner();
    store
        .write(move |c| {
            Box::pin(async move {
                sqlx::query(
                    "UPDATE tracker_runs SET sync_owner = NULL, sync_until = NULL \
                     WHERE run_id = ? AND sync_owner = ?",
                )
                .bind(run_id)
                .bind(me)
                .execute(&mut *c)
                .await?;
                Ok(0)
            })
        })
        .await
        .map(|_| ())
}

/// Records how far the metrics are pushed: `cursor` is accepted remotely, `inflight` (the last
/// row of a batch posted and not answered yet) may or may not be.
async fn set_cursor(store: &Store, run_id: i64, cursor: i64, inflight: Option<i64>) -> Result<()> {
    fenced_update(
        store,
        run_id,
        "metric_cursor = ?, inflight_upto = ?",
        vec![Arg::Int(Some(cursor)), Arg::Int(inflight)],
    )
    .await
}

/// A value bound into [`fenced_update`]'s SET clause.
enum Arg {
    Int(Option<i64>),
    Real(f64),
    Text(String),
}

/// Updates run `run_id`'s `tracker_runs` row with `set` (a SET clause whose `?` take `args`)
/// only while this process holds the run's push lease. When nothing changed, another process
/// (or a resume's rewind) took the lease, and this push must stop before it writes anything
/// else.
async fn fenced_update(
    store: &Store,
    run_id: i64,
    set: &'static str,
    args: Vec<Arg>,
) -> Result<()> {
    let changed = store
        .write(move |c| {
            Box::pin(async move {
                // `set` is one of this file's constant clauses.
                let sql =
                    format!("UPDATE tracker_runs SET {set} WHERE run_id = ? AND sync_owner = ?");
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
                for a in &args {
                    q = match a {
                        Arg::Int(v) => q.bind(*v),
                        Arg::Real(v) => q.bind(*v),
                        Arg::Text(v) => q.bind(v.clone()),
                    };
                }
                let r = q.bind(run_id).bind(owner()).execute(&mut *c).await?;
                Ok(r.rows_affected() as i64)
            })
        })
        .await?;
    if changed == 0 {
        bail!("run {run_id}: another process took over its push; it stays pending");
    }
    Ok(())
}

/// Extends this process's lease on `run_id` before a remote call, or fails if it was lost.
async fn renew(store: &Store, run_id: i64, timeout: Duration) -> Result<()> {
    let until = now() + (timeout * 3).as_secs_f64() + 5.0;
    fenced_update(
        store,
        run_id,
        "sync_until = MAX(COALESCE(sync_until, 0), ?)",
        vec![Arg::Real(until)],
    )
    .await
}

/// A metric's wall time as MLflow's timestamp (ms).
fn millis(wall: f64) -> i64 {
    (wall * 1000.0) as i64
}

/// Pushes what is pending for `run_id`, in order, until done, an error, or `deadline`.
/// `uri` overrides the stored tracker address. Refuses, naming the holder, while another
/// process pushes the same run.
pub async fn sync_run(
    store: &Store,
    run_id: i64,
    uri: Option<&str>,
    timeout: Duration,
    deadline: Instant,
) -> Result<Pending> {
    let tracked: Option<i64> =
        sqlx::query_scalar("SELECT run_id FROM tracker_runs WHERE run_id = ?")
            .bind(run_id)
            .fetch_optional(store.pool())
            .await?;
    if tracked.is_none() {
        bail!("run {run_id} is not tracked remotely");
    }
    // One call may overrun the deadline by its timeout; a few more for the records after it.
    let lease = deadline.saturating_duration_since(Instant::now()) + timeout * 2;
    let until = now() + lease.as_secs_f64() + 5.0;
    if let Some(holder) = claim(store, run_id, until).await? {
        bail!("run {run_id} is being pushed by another process ({holder}); it stays pending");
    }
    let result = push_pending(store, run_id, uri, timeout, deadline).await;
    let released = release(store, run_id).await;
    let pending = result?;
    released?;
    Ok(pending)
}

async fn push_pending(
    store: &Store,
    run_id: i64,
    uri: Option<&str>,
    timeout: Duration,
    deadline: Instant,
) -> Result<Pending> {
    let row = sqlx::query(
        "SELECT uri, remote_run_id, metric_cursor, inflight_upto FROM tracker_runs WHERE run_id = ?",
    )
    .bind(run_id)
    .fetch_one(store.pool())
    .await?;
    let stored_uri: String = row.get(0);
    let client = MlflowClient::new(uri.unwrap_or(&stored_uri), timeout)?;
    let mut remote: Option<String> = row.get(1);
    let mut cursor: i64 = row.get(2);
    let mut inflight: Option<i64> = row.get(3);
    // 1. create and params, in order (status records wait until the metrics are out).
    let records = sqlx::query(
        "SELECT id, kind, payload FROM outbox WHERE run_id = ? AND done IS NULL ORDER BY id",
    )
    .bind(run_id)
    .fetch_all(store.pool())
    .await?;
    let mut statuses = Vec::new();
    for r in records {
        let (id, kind, payload): (i64, String, String) = (r.get(0), r.get(1), r.get(2));
        let payload: Value = serde_json::from_str(&payload).unwrap_or(Value::Null);
        if kind == "status" {
            statuses.push((id, payload));
            continue;
        }
        if Instant::now() > deadline {
            return pending(store, run_id).await;
        }
        renew(store, run_id, timeout).await?;
        let result = match kind.as_str() {
            "rewind" => {
                remote = None;
                cursor = 0;
                inflight = None;
                match payload["remote_run_id"].as_str() {
                    Some(old) => client
                        .post("runs/delete", json!({"run_id": old}))
                        .await
                        .map(|_| ()),
                    None => Ok(()),
                }
            }
            "create" => push_create(&client, store, run_id, &payload)
                .await
                .map(|rid| {
                    remote = Some(rid);
                }),
            "params" => match &remote {
                Some(rid) => push_params(&client, rid, &payload).await,
                None => Err(CallError {
                    permanent: false,
                    message: "the remote run is not created yet".into(),
                }),
            },
            "generations" => match &remote {
                Some(rid) => {
                    let step = payload["step"].as_i64().unwrap_or(0);
                    client
                        .put_artifact(
                            rid,
                            &format!("val_generations/step_{step:06}.json"),
                            serde_json::to_vec_pretty(&payload["rows"]).unwrap_or_default(),
                        )
                        .await
                }
                None => Err(CallError {
                    permanent: false,
                    message: "the remote run is not created yet".into(),
                }),
            },
            other => Err(CallError {
                permanent: true,
                message: format!("unknown outbox record kind {other:?}"),
            }),
        };
        match result {
            Ok(()) => mark(store, id, true, None).await?,
            Err(e) if e.permanent => {
                mark(store, id, true, Some(e.message.clone())).await?;
                store.event(
                    Some(run_id),
                    "tracker",
                    format!("gave up on a {kind} record: {}", e.message),
                )?;
            }
            Err(e) => {
                mark(store, id, false, Some(e.message.clone())).await?;
                bail!("{}", e.message);
            }
        }
    }
    let Some(rid) = remote else {
        return pending(store, run_id).await;
    };
    // 2. a batch posted before whose answer never came back: sent again only if it never landed.
    if let Some(upto) = inflight {
        renew(store, run_id, timeout).await?;
        let last: Option<(String, i64, f64)> =
            sqlx::query_as("SELECT key, step, wall_time FROM metrics WHERE id = ? AND run_id = ?")
                .bind(upto)
                .bind(run_id)
                .fetch_optional(store.pool())
                .await?;
        let landed = match last {
            Some((key, step, wall)) => {
                match client.has_metric(&rid, &key, step, millis(wall)).await {
                    Ok(found) => found,
                    // Refused for good (the remote run is gone, say): sent again, and the batch's
                    // own answer decides.
                    Err(e) if e.permanent => false,
                    Err(e) => bail!("{}", e.message),
                }
            }
            None => false,
        };
        if landed {
            cursor = upto;
        }
        set_cursor(store, run_id, cursor, None).await?;
    }
    // 3. metrics past the cursor, in chunks of MLflow's batch limit.
    loop {
        if Instant::now() > deadline {
            return pending(store, run_id).await;
        }
        let rows = sqlx::query(
            "SELECT id, step, key, value, wall_time FROM metrics WHERE run_id = ? AND id > ? ORDER BY id LIMIT ?",
        )
        .bind(run_id)
        .bind(cursor)
        .bind(MAX_METRICS_PER_BATCH as i64)
        .fetch_all(store.pool())
        .await?;
        if rows.is_empty() {
            break;
        }
        let last: i64 = rows[rows.len() - 1].get(0);
        let metrics: Vec<Value> = rows
            .iter()
            .map(|r| {
                let v: Option<f64> = r.get(3);
                json!({"key": r.get::<String, _>(2), "value": metric_value(v.unwrap_or(f64::NAN)),
                       "timestamp": millis(r.get(4)), "step": r.get::<i64, _>(1)})
            })
            .collect();
        renew(store, run_id, timeout).await?;
        set_cursor(store, run_id, cursor, Some(last)).await?;
        match client
            .post("runs/log-batch", json!({"run_id": rid, "metrics": metrics}))
            .await
        {
            Ok(_) => {}
            // Refused as a whole: the server stored none of it.
            Err(e) if e.permanent => {
                store.event(
                    Some(run_id),
                    "tracker",
                    format!("metrics rejected: {}", e.message),
                )?;
            }
            Err(e) => bail!("{}", e.message),
        }
        cursor = last;
        set_cursor(store, run_id, cursor, None).await?;
    }
    // 4. status changes.
    for (id, payload) in statuses {
        renew(store, run_id, timeout).await?;
        let mut body = json!({"run_id": rid, "status": payload["status"]});
        if let Some(t) = payload.get("end_time").and_then(Value::as_i64) {
            body["end_time"] = json!(t);
        }
        match client.post("runs/update", body).await {
            Ok(_) => mark(store, id, true, None).await?,
            Err(e) if e.permanent => mark(store, id, true, Some(e.message)).await?,
            Err(e) => {
                mark(store, id, false, Some(e.message.clone())).await?;
                bail!("{}", e.message);
            }
        }
    }
    pending(store, run_id).await
}

async fn push_create(
    client: &MlflowClient,
    store: &Store,
    run_id: i64,
    p: &Value,
) -> Result<String, CallError> {
    let name = p["experiment"].as_str().unwrap_or("rl-posttrain");
    let exp = client.experiment_id(name).await?;
    // Created before, and the answer lost: adopt that run instead of creating a second one.
    let found = match p["tags"][CREATE_TOKEN].as_str() {
        Some(token) => client.find_run_by_tag(&exp, CREATE_TOKEN, token).await?,
        None => None,
    };
    if let Some(rid) = found {
        record_remote(store, run_id, &rid, &exp).await?;
        return Ok(rid);
    }
    let tags: Vec<Value> = p["tags"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| json!({"key": k, "value": v}))
                .collect()
        })
        .unwrap_or_default();
    let v = client
        .post(
            "runs/create",
            json!({"experiment_id": exp, "run_name": p["run_name"], "start_time": p["start_time"], "tags": tags}),
        )
        .await?;
    let rid = v
        .pointer("/run/info/run_id")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| CallError {
            permanent: true,
            message: format!("runs/create answered without a run id: {v}"),
        })?;
    record_remote(store, run_id, &rid, &exp).await?;
    Ok(rid)
}

async fn record_remote(store: &Store, run_id: i64, rid: &str, exp: &str) -> Result<(), CallError> {
    fenced_update(
        store,
        run_id,
        "remote_run_id = ?, experiment_id = ?",
        vec![Arg::Text(rid.to_owned()), Arg::Text(exp.to_owned())],
    )
    .await
    .map_err(|e| CallError {
        permanent: false,
        message: format!("recording the remote run id: {e:#}"),
    })
}

/// Sends the params the remote run does not have yet; a param it has with another value is a
/// permanent error naming it (MLflow never changes a param).
async fn push_params(client: &MlflowClient, rid: &str, p: &Value) -> Result<(), CallError> {
    let params: Vec<(String, String)> =
        serde_json::from_value(p.clone()).map_err(|e| CallError {
            permanent: true,
            message: format!("a params record that is not a list of [key, value] pairs: {e}"),
        })?;
    let have = client.run_params(rid).await?;
    let changed: Vec<String> = params
        .iter()
        .filter_map(|(k, v)| {
            let old = have.get(k)?;
            (old != v).then(|| format!("{k} (remote {old:?}, ours {v:?})"))
        })
        .collect();
    if !changed.is_empty() {
        return Err(CallError {
            permanent: true,
            message: format!(
                "remote run {rid} already has other values for {} params: {}",
                changed.len(),
                changed.join(", ")
            ),
        });
    }
    let missing: Vec<&(String, String)> = params
        .iter()
        .filter(|(k, _)| !have.contains_key(k))
        .collect();
    for chunk in missing.chunks(MAX_PARAMS_PER_BATCH) {
        let params: Vec<Value> = chunk
            .iter()
            .map(|(k, v)| json!({"key": k, "value": v}))
            .collect();
        client
            .post("runs/log-batch", json!({"run_id": rid, "params": params}))
            .await
            // Someone else's copy of the same params landed in between: diff again next time.
            .map_err(|mut e| {
                if e.message.contains("RESOURCE_ALREADY_EXISTS") {
                    e.permanent = false;
                }
                e
            })?;
    }
    Ok(())
}

/// The background push while a run trains: every `interval_s`, errors only logged.
pub struct Pump {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Pump {
    /// Starts pushing `run_id` in the background on `rt`.
    pub fn start(rt: &Runtime, store: Store, run_id: i64, cfg: TrackerConfig) -> Pump {
        let (stop, stopped) = watch::channel(false);
        let task = rt.spawn(pump(store, run_id, cfg, stopped));
        Pump { stop, task }
    }

    /// Stops after the push under way, never in the middle of one (a call cut off after the
    /// server acted would be sent again by the next pusher), and waits for it.
    pub fn stop(self, rt: &Runtime) {
        let _ = self.stop.send(true);
        if let Err(e) = rt.block_on(self.task) {
            tracing::warn!("the tracker's background push ended badly: {e}");
        }
    }
}

async fn pump(store: Store, run_id: i64, cfg: TrackerConfig, mut stopped: watch::Receiver<bool>) {
    let timeout = Duration::from_secs_f64(cfg.timeout_s);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(cfg.interval_s));
    let mut warned = false;
    loop {
        tokio::select! {
            biased;
            _ = stopped.changed() => return,
            _ = tick.tick() => {}
        }
        let deadline = Instant::now() + Duration::from_secs_f64(cfg.interval_s.max(1.0));
        if let Err(e) = sync_run(&store, run_id, None, timeout, deadline).await {
            if !warned {
                tracing::warn!(
                    "tracker unavailable, records stay pending for `harness sync`: {e:#}"
                );
                warned = true;
            }
        } else {
            warned = false;
        }
    }
}

/// How many failed pushes in a row without progress the end-of-run flush tries before it
/// leaves the rest pending.
const FLUSH_TRIES: usize = 3;

/// At the end of a run: keep pushing for at most `budget`, then leave the rest to `harness sync`.
pub async fn flush_run(store: &Store, run_id: i64, cfg: &TrackerConfig, budget: Duration) {
    let timeout =
        Duration::from_secs_f64(cfg.timeout_s).min(budget.max(Duration::from_millis(100)));
    let deadline = Instant::now() + budget;
    if let Err(e) = store.flush().await {
        tracing::warn!("flushing run {run_id}: {e:#}");
    }
    // A lost answer is worth another try, and a push that failed after moving records out made
    // progress (a lossy link, not a dead server): only failures in a row that move nothing
    // count. A server that is down fails fast three times and the rest waits for `harness sync`;
    // the budget bounds the whole flush either way.
    let mut failures = 0;
    let mut left = pending(store, run_id).await.ok();
    while Instant::now() < deadline {
        match sync_run(store, run_id, None, timeout, deadline).await {
            Ok(p) if p.is_empty() => return,
            Ok(p) => left = Some(p),
            Err(e) => {
                let now_left = pending(store, run_id).await.ok();
                let moved = matches!((left, now_left), (Some(a), Some(b)) if b.total() < a.total());
                left = now_left;
                failures = if moved { 0 } else { failures + 1 };
                if failures >= FLUSH_TRIES {
                    tracing::warn!("tracker: run {run_id} left pending for `harness sync`: {e:#}");
                    return;
                }
                let wait = deadline.saturating_duration_since(Instant::now());
                tokio::time::sleep(Duration::from_millis(500).min(wait)).await;
            }
        }
    }
}

/// `harness sync`: pushes everything pending for every tracked run; errors if anything is
/// still pending at the end.
pub async fn sync_all(
    store: &Store,
    uri: Option<&str>,
    timeout: Duration,
    budget: Duration,
) -> Result<Vec<(i64, Pending)>> {
    let runs: Vec<i64> = sqlx::query_scalar("SELECT run_id FROM tracker_runs ORDER BY run_id")
        .fetch_all(store.pool())
        .await?;
    let deadline = Instant::now() + budget;
    let mut out = Vec::new();
    let mut failures = Vec::new();
    for run in runs {
        let before = pending(store, run).await?;
        if before.is_empty() {
            continue;
        }
        match sync_run(store, run, uri, timeout, deadline).await {
            Ok(p) => {
                if !p.is_empty() {
                    failures.push(format!(
                        "run {run}: {} records and {} metrics still pending (time budget spent)",
                        p.records, p.metrics
                    ));
                }
                out.push((run, before));
            }
            Err(e) => failures.push(format!("run {run}: {e:#}")),
        }
    }
    if !failures.is_empty() {
        return Err(anyhow!("tracker sync incomplete: {}", failures.join("; ")));
    }
    Ok(out)
}
