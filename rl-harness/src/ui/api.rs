//! The JSON views of the run browser, one function per view, each reading the store only
//! through the queries `harness runs`, `show` and `compare` use. A view's error is a
//! [`Fault`]: a bad request (a filter that does not parse, a run id that is not a number), a
//! thing not found (a run or sweep the store lacks), or the store failing; each names what is
//! at fault.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use crate::analysis::compare::{self, Mode};
use crate::analysis::{listing, sweep};
use crate::config;
use crate::store::{RunRow, Store, filter};

/// Why a view has no answer.
#[derive(Debug)]
pub enum Fault {
    /// The request is wrong (HTTP 400); the message says how.
    BadRequest(String),
    /// It names something the store lacks (HTTP 404).
    NotFound(String),
    /// Reading the store failed (HTTP 500).
    Store(anyhow::Error),
}

impl From<anyhow::Error> for Fault {
    fn from(e: anyhow::Error) -> Fault {
        Fault::Store(e)
    }
}

/// A view's answer.
pub type Answer = Result<Value, Fault>;

/// A float for JSON: NaN and infinities (which JSON lacks) as `null`.
fn num(v: f64) -> Value {
    serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)
}

/// A run id from the request: an error naming the text when it is not one.
pub fn run_id(text: &str) -> Result<i64, Fault> {
    text.trim()
        .parse()
        .map_err(|_| Fault::BadRequest(format!("run id `{text}` is not a number")))
}

/// The run `id` names, or a [`Fault::NotFound`] naming it and the store.
async fn run_of(store: &Store, id: i64) -> Result<RunRow, Fault> {
    store
        .run(id)
        .await?
        .ok_or_else(|| Fault::NotFound(format!("no run {id} in {}", store.path().display())))
}

/// The runs `ids` name, in that order; at least `min` of them.
async fn runs_of(store: &Store, ids: &[i64], min: usize) -> Result<Vec<RunRow>, Fault> {
    if ids.len() < min {
        return Err(Fault::BadRequest(format!(
            "name at least {min} run(s) with `run=ID`"
        )));
    }
    let mut runs = Vec::new();
    for &id in ids {
        runs.push(run_of(store, id).await?);
    }
    Ok(runs)
}

/// `trainer.algorithm`, with the advantage estimator of an on-policy run (`on_policy/grpo`).
fn algorithm(table: &BTreeMap<String, Value>) -> String {
    let text = |k: &str| table.get(k).and_then(Value::as_str).unwrap_or("");
    match text("trainer.algorithm") {
        "on_policy" => format!("on_policy/{}", text("algorithm.adv_estimator")),
        other => other.to_string(),
    }
}

/// Every run (those `filter` keeps, when given: the language of `harness runs --filter`), with
/// what the runs table shows, and the sweeps' names for grouping.
pub async fn runs(store: &Store, filter: Option<&str>) -> Answer {
    let filter = filter.map(str::trim).filter(|f| !f.is_empty());
    let expr = filter
        .map(filter::parse)
        .transpose()
        .map_err(|e| Fault::BadRequest(format!("{e:#}")))?;
    let runs = store.runs(None).await?;
    let total = runs.len();
    let listed = listing::filtered(store, runs, expr.as_ref(), "filter")
        .await
        .map_err(|e| match e.downcast_ref::<listing::UnknownFilterKey>() {
            Some(_) => Fault::BadRequest(format!("{e:#}")),
            None => Fault::Store(e),
        })?;
    let mut rows = Vec::new();
    for l in &listed {
        let (r, table, step) = (&l.run, &l.table, &l.last_step);
        let metric = listing::main_metric(table);
        rows.push(json!({
            "id": r.id,
            "name": r.name,
            "project": r.project,
            "status": r.effective_status(),
            "algorithm": algorithm(table),
            "seed": r.seed,
            "step": step,
            "duration_s": listing::duration_s(r).map(num),
            "created": num(r.created),
            "started": r.started.map(num),
            "sweep": r.sweep_id,
            "trial": r.trial_id,
            "metric_key": metric.as_ref().map(|m| m.0.clone()),
            "metric": metric.map(|m| num(m.1)),
            "error": r.error,
        }));
    }
    let sweeps: BTreeMap<String, String> = sweep::sweeps(store)
        .await?
        .into_iter()
        .map(|s| (s.id, s.name))
        .collect();
    Ok(json!({ "runs": rows, "total": total, "sweeps": sweeps }))
}

/// The metric keys the runs `ids` recorded (every run's when none is named), sorted.
pub async fn keys(store: &Store, ids: &[i64]) -> Answer {
    let runs = if ids.is_empty() {
        store.runs(None).await?
    } else {
        runs_of(store, ids, 0).await?
    };
    let mut keys = BTreeSet::new();
    for r in &runs {
        keys.extend(store.final_metrics(r.id).await?.into_keys());
    }
    Ok(json!({ "keys": keys }))
}

/// The series of metrics `keys` of runs `ids`: per (run, key), the steps, wall-clock times and
/// values (NaN as null). A key a run never recorded gives an empty series.
pub async fn series(store: &Store, ids: &[i64], keys: &[String]) -> Answer {
    let runs = runs_of(store, ids, 1).await?;
    if keys.is_empty() {
        return Err(Fault::BadRequest(
            "name at least one metric with `key=NAME`".into(),
        ));
    }
    let mut out = Vec::new();
    for r in &runs {
        for key in keys {
            let s = store.series_timed(r.id, key).await?;
            out.push(json!({
                "run": r.id,
                "key": key,
                "status": r.effective_status(),
                "steps": s.iter().map(|p| p.0).collect::<Vec<_>>(),
                "times": s.iter().map(|p| num(p.1)).collect::<Vec<_>>(),
                "values": s.iter().map(|p| num(p.2)).collect::<Vec<_>>(),
            }));
        }
    }
    Ok(json!({ "series": out }))
}

/// One run: its fields, resolved config by group, final metrics, checkpoints, events, the
/// validation generations it kept, and the command that resumes it.
pub async fn run(store: &Store, id: i64) -> Answer {
    let r = run_of(store, id).await?;
    let groups: Vec<Value> = listing::config_groups(&r)?
        .into_iter()
        .map(|g| {
            let as_json = serde_json::to_value(&g.table).unwrap_or(Value::Null);
            let entries: Vec<Value> = config::flatten(&as_json)
                .into_iter()
                .map(|(k, v)| json!([k, v]))
                .collect();
            json!({ "name": g.name, "at_default": g.at_default, "entries": entries })
        })
        .collect();
    let metrics: Vec<Value> = store
        .final_metrics(id)
        .await?
        .into_iter()
        .map(|(k, (step, v))| json!({ "key": k, "step": step, "value": num(v) }))
        .collect();
    let checkpoints: Vec<Value> = store
        .checkpoints(id)
        .await?
        .into_iter()
        .map(|c| json!({ "step": c.step, "path": c.path, "created": num(c.created) }))
        .collect();
    let events: Vec<Value> = store
        .events(id)
        .await?
        .into_iter()
        .map(|e| json!({ "time": num(e.time), "kind": e.kind, "message": e.message }))
        .collect();
    let generations: Vec<Value> = store
        .generations(id)
        .await?
        .into_iter()
        .map(|g| {
            json!({
                "step": g.step, "data_source": g.data_source, "prompt": g.prompt,
                "response": g.response, "score": num(g.score),
            })
        })
        .collect();
    let db = std::path::absolute(store.path()).unwrap_or_else(|_| store.path().to_path_buf());
    Ok(json!({
        "id": r.id,
        "name": r.name,
        "project": r.project,
        "status": r.effective_status(),
        "stored_status": r.status,
        "seed": r.seed,
        "host": r.host,
        "pid": r.pid,
        "run_dir": r.run_dir,
        "git_commit": r.git_commit,
        "git_dirty": r.git_dirty,
        "created": num(r.created),
        "started": r.started.map(num),
        "ended": r.ended.map(num),
        "heartbeat": r.heartbeat.map(num),
        "sweep": r.sweep_id,
        "trial": r.trial_id,
        "resumed_from": r.resumed_from,
        "error": r.error,
        "config": groups,
        "metrics": metrics,
        "checkpoints": checkpoints,
        "events": events,
        "generations": generations,
        "resume_command": format!("harness --db {} resume {}", db.display(), r.id),
    }))
}

/// The config keys whose values differ between runs `ids` (at least two), each run's value.
pub async fn diff(store: &Store, ids: &[i64]) -> Answer {
    let runs = runs_of(store, ids, 2).await?;
    let rows: Vec<Value> = compare::config_differences(&runs)?
        .into_iter()
        .map(|(key, values)| json!({ "key": key, "values": values }))
        .collect();
    let heads: Vec<Value> = runs
        .iter()
        .map(|r| json!({ "id": r.id, "name": r.name, "status": r.effective_status() }))
        .collect();
    Ok(json!({ "runs": heads, "rows": rows }))
}

/// Every sweep: id, name, the metric it ranks by, its trial count.
pub async fn sweeps(store: &Store) -> Answer {
    let list: Vec<Value> = sweep::sweeps(store)
        .await?
        .into_iter()
        .map(|s| json!({ "id": s.id, "name": s.name, "metric": s.metric, "trials": s.trials }))
        .collect();
    Ok(json!({ "sweeps": list }))
}

/// A sweep's trials ranked by `metric` (its own metric by default) under `mode`, with every
/// parameter, for the ranking table and the parallel-coordinates view.
pub async fn sweep_view(store: &Store, spec: &str, metric: Option<&str>, mode: Mode) -> Answer {
    let id = store
        .resolve_sweep(spec)
        .await
        .map_err(|e| Fault::NotFound(format!("{e:#}")))?;
    let metric = match metric.map(str::trim).filter(|m| !m.is_empty()) {
        Some(m) => m.to_string(),
        None => sweep::sweeps(store)
            .await?
            .into_iter()
            .find(|s| s.id == id)
            .and_then(|s| s.metric)
            .unwrap_or_else(|| "val/test_score".into()),
    };
    let maximise = mode.maximise(&metric);
    let (id, ranked) = compare::rank_trials(store, &id, &metric, maximise).await?;
    let params: BTreeSet<&String> = ranked.iter().flat_map(|r| r.trial.params.keys()).collect();
    let trials: Vec<Value> = ranked
        .iter()
        .map(|r| {
            json!({
                "trial": r.trial.trial_id, "state": r.trial.state, "run": r.trial.run_id,
                "best": r.best.map(num), "params": r.trial.params,
            })
        })
        .collect();
    Ok(json!({
        "id": id, "metric": metric, "maximise": maximise,
        "params": params, "trials": trials,
    }))
}
