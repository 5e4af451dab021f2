//! The remote tracker: mirrors runs, params and metrics to an MLflow-compatible REST server
//! (`experiments/get-by-name|create`, `runs/create`, `runs/log-batch`, `runs/update`).
//!
//! SQLite stays the source of truth. Run creation, params and status changes are written to the
//! `outbox` table in the same transaction as the change itself; metrics are pushed by rowid past
//! each run's cursor in `tracker_runs`. A background task pushes while training; a tracker that
//! is down or slow only leaves records pending (never blocks or fails training), and
//! `harness sync` pushes them later.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};
use sqlx::Row;
use sqlx::sqlite::SqliteConnection;

use crate::config::{self, ExperimentConfig, TrackerConfig};
use crate::store::{Store, now};

/// MLflow's limits for one `runs/log-batch` call.
pub const MAX_METRICS_PER_BATCH: usize = 1000;
/// MLflow's limit of params per `runs/log-batch` call.
pub const MAX_PARAMS_PER_BATCH: usize = 100;
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
        "INSERT OR REPLACE INTO tracker_runs (run_id, uri, metric_cursor) VALUES (?, ?, 0)",
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
        "tags": {"harness.run_id": run_id.to_string(), "mlflow.runName": format!("{}-{run_id}", cfg.trainer.experiment_name)},
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
        sqlx::query("INSERT INTO outbox (run_id, kind, payload, created) VALUES (?, ?, ?, ?)")
            .bind(run_id)
            .bind(kind)
            .bind(payload.to_string())
            .bind(t)
            .execute(&mut *c)
            .await?;
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
    let payload = json!({"remote_run_id": old, "step": step});
    sqlx::query("INSERT INTO outbox (run_id, kind, payload, created) VALUES (?, 'rewind', ?, ?)")
        .bind(run_id)
        .bind(payload.to_string())
        .bind(now())
        .execute(&mut *c)
        .await?;
    // a fresh remote run, metrics pushed from the first one on
    enqueue_start(c, run_id, cfg).await?;
    Ok(true)
}

/// Records a status change in the outbox, for runs that are tracked.
pub async fn enqueue_status(
    c: &mut SqliteConnection,
    run_id: i64,
    status: &str,
    end_time: Option<f64>,
) -> Result<()> {
    let tracked: Option<i64> =
        sqlx::query_scalar("SELECT run_id FROM tracker_runs WHERE run_id = ?")
            .bind(run_id)
            .fetch_optional(&mut *c)
            .await?;
    if tracked.is_none() {
        return Ok(());
    }
    let mlflow = match status {
        "running" => "RUNNING",
        "finished" => "FINISHED",
        "failed" => "FAILED",
        _ => "KILLED",
    };
    let payload = json!({"status": mlflow, "end_time": end_time.map(|t| (t * 1000.0) as i64)});
    sqlx::query("INSERT INTO outbox (run_id, kind, payload, created) VALUES (?, 'status', ?, ?)")
        .bind(run_id)
        .bind(payload.to_string())
        .bind(now())
        .execute(&mut *c)
        .await?;
    Ok(())
}

/// A failed call: transient ones are retried, permanent ones are recorded and skipped.
#[derive(Debug)]
struct CallError {
    permanent: bool,
    message: String,
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A small MLflow REST client.
pub struct MlflowClient {
    http: reqwest::Client,
    base: String,
}

impl MlflowClient {
    /// A client for `uri` with a per-request timeout.
    pub fn new(uri: &str, timeout: Duration) -> Result<MlflowClient> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .context("building the HTTP client")?;
        Ok(MlflowClient {
            http,
            base: format!("{}/api/2.0/mlflow", uri.trim_end_matches('/')),
        })
    }

    async fn call(
        &self,
        method: reqwest::Method,
        endpoint: &str,
        body: Option<Value>,
        query: &[(&str, &str)],
    ) -> Result<Value, CallError> {
        let mut url = format!("{}/{endpoint}", self.base);
        for (i, (k, v)) in query.iter().enumerate() {
            url.push(if i == 0 { '?' } else { '&' });
            url.push_str(&format!("{k}={}", encode(v)));
        }
        let mut req = self.http.request(method, &url);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.map_err(|e| CallError {
            permanent: false,
            message: format!("{url}: {e}"),
        })?;
        let status = resp.status();
        let text = resp.text().await.map_err(|e| CallError {
            permanent: false,
            message: format!("{url}: reading the answer: {e}"),
        })?;
        if status.is_success() {
            return Ok(serde_json::from_str(&text).unwrap_or(Value::Null));
        }
        let code = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| {
                v.get("error_code")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        Err(CallError {
            permanent: status.is_client_error() && status.as_u16() != 429 && status.as_u16() != 408,
            message: format!(
                "{url}: HTTP {status} {code}: {}",
                text.chars().take(300).collect::<String>()
            ),
        })
    }

    async fn post(&self, endpoint: &str, body: Value) -> Result<Value, CallError> {
        self.call(reqwest::Method::POST, endpoint, Some(body), &[])
            .await
    }

    /// The id of the experiment named `name`, created if needed.
    async fn experiment_id(&self, name: &str) -> Result<String, CallError> {
        let found = self
            .call(
                reqwest::Method::GET,
                "experiments/get-by-name",
                None,
                &[("experiment_name", name)],
            )
            .await;
        let id_of = |v: &Value| {
            v.pointer("/experiment/experiment_id")
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        match found {
            Ok(v) => id_of(&v).ok_or_else(|| CallError {
                permanent: true,
                message: format!("experiments/get-by-name answered without an id: {v}"),
            }),
            Err(e) if e.permanent => {
                match self.post("experiments/create", json!({"name": name})).await {
                    Ok(v) => v
                        .get("experiment_id")
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                        .ok_or_else(|| CallError {
                            permanent: true,
                            message: format!("experiments/create answered without an id: {v}"),
                        }),
                    // Created by someone else in between.
                    Err(e) if e.message.contains("RESOURCE_ALREADY_EXISTS") => {
                        let v = self
                            .call(
                                reqwest::Method::GET,
                                "experiments/get-by-name",
                                None,
                                &[("experiment_name", name)],
                            )
                            .await?;
                        id_of(&v).ok_or(e)
                    }
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }
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
        self.records == 0 && self.metrics == 0
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

/// Pushes what is pending for `run_id`, in order, until done, an error, or `deadline`.
/// `uri` overrides the stored tracker address.
pub async fn sync_run(
    store: &Store,
    run_id: i64,
    uri: Option<&str>,
    timeout: Duration,
    deadline: Instant,
) -> Result<Pending> {
    let row = sqlx::query("SELECT uri, experiment_id, remote_run_id, metric_cursor FROM tracker_runs WHERE run_id = ?")
        .bind(run_id)
        .fetch_optional(store.pool())
        .await?
        .with_context(|| format!("run {run_id} is not tracked remotely"))?;
    let stored_uri: String = row.get(0);
    let client = MlflowClient::new(uri.unwrap_or(&stored_uri), timeout)?;
    let mut remote: Option<String> = row.get(2);
    let mut cursor: i64 = row.get(3);
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
        let result = match kind.as_str() {
            "rewind" => {
                remote = None;
                cursor = 0;
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
    // 2. metrics past the cursor, in chunks of MLflow's batch limit.
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
                let wall: f64 = r.get(4);
                json!({"key": r.get::<String, _>(2), "value": metric_value(v.unwrap_or(f64::NAN)),
                       "timestamp": (wall * 1000.0) as i64, "step": r.get::<i64, _>(1)})
            })
            .collect();
        match client
            .post("runs/log-batch", json!({"run_id": rid, "metrics": metrics}))
            .await
        {
            Ok(_) => {}
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
        store
            .write(move |c| {
                Box::pin(async move {
                    sqlx::query("UPDATE tracker_runs SET metric_cursor = ? WHERE run_id = ?")
                        .bind(last)
                        .bind(run_id)
                        .execute(&mut *c)
                        .await?;
                    Ok(0)
                })
            })
            .await?;
    }
    // 3. status changes.
    for (id, payload) in statuses {
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

/// MLflow's JSON takes non-finite doubles as strings.
fn metric_value(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else if v.is_nan() {
        json!("NaN")
    } else if v > 0.0 {
        json!("Infinity")
    } else {
        json!("-Infinity")
    }
}

async fn push_create(
    client: &MlflowClient,
    store: &Store,
    run_id: i64,
    p: &Value,
) -> Result<String, CallError> {
    let name = p["experiment"].as_str().unwrap_or("rl-posttrain");
    let exp = client.experiment_id(name).await?;
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
    let (rid2, exp2) = (rid.clone(), exp.clone());
    store
        .write(move |c| {
            Box::pin(async move {
                sqlx::query(
                    "UPDATE tracker_runs SET remote_run_id = ?, experiment_id = ? WHERE run_id = ?",
                )
                .bind(rid2)
                .bind(exp2)
                .bind(run_id)
                .execute(&mut *c)
                .await?;
                Ok(0)
            })
        })
        .await
        .map_err(|e| CallError {
            permanent: false,
            message: format!("recording the remote run id: {e:#}"),
        })?;
    Ok(rid)
}

async fn push_params(client: &MlflowClient, rid: &str, p: &Value) -> Result<(), CallError> {
    let params: Vec<(String, String)> = serde_json::from_value(p.clone()).unwrap_or_default();
    for chunk in params.chunks(MAX_PARAMS_PER_BATCH) {
        let params: Vec<Value> = chunk
            .iter()
            .map(|(k, v)| json!({"key": k, "value": v}))
            .collect();
        client
            .post("runs/log-batch", json!({"run_id": rid, "params": params}))
            .await?;
    }
    Ok(())
}

/// The background push while a run trains: every `interval_s`, errors only logged.
pub async fn pump(store: Store, run_id: i64, cfg: TrackerConfig) {
    let timeout = Duration::from_secs_f64(cfg.timeout_s);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(cfg.interval_s));
    let mut warned = false;
    loop {
        tick.tick().await;
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

/// At the end of a run: keep pushing for at most `budget`, then leave the rest to `harness sync`.
pub async fn flush_run(store: &Store, run_id: i64, cfg: &TrackerConfig, budget: Duration) {
    let timeout =
        Duration::from_secs_f64(cfg.timeout_s).min(budget.max(Duration::from_millis(100)));
    let deadline = Instant::now() + budget;
    if let Err(e) = store.flush().await {
        tracing::warn!("flushing run {run_id}: {e:#}");
    }
    while Instant::now() < deadline {
        match sync_run(store, run_id, None, timeout, deadline).await {
            Ok(p) if p.is_empty() => return,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!("tracker: run {run_id} left pending for `harness sync`: {e:#}");
                return;
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
