//! What `harness runs`, `harness show` and the run browser (`harness ui`) list about a run: the
//! table `--filter` evaluates (config keys, final metrics, run fields), its main validation
//! metric, how long it ran, a filter's keys checked against every run's, and its config by
//! group with the groups left at their defaults marked.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::config;
use crate::store::{RunRow, Store, filter};

/// What `--filter` sees of a run (config keys, final metrics, run fields), and the last step
/// it recorded a metric at (`None`: none yet).
pub async fn lookup_table(
    store: &Store,
    r: &RunRow,
) -> Result<(BTreeMap<String, Value>, Option<i64>)> {
    let cfg: Value = serde_json::from_str(&r.config)
        .with_context(|| format!("the stored config of run {}", r.id))?;
    let mut m = config::flatten(&cfg);
    let mut last = None;
    for (k, (step, v)) in store.final_metrics(r.id).await? {
        last = last.max(Some(step));
        m.insert(k, serde_json::json!(v));
    }
    m.insert("id".into(), r.id.into());
    m.insert("name".into(), r.name.clone().into());
    m.insert("status".into(), r.effective_status().into());
    m.insert("project".into(), r.project.clone().into());
    m.insert("seed".into(), r.seed.into());
    m.insert(
        "sweep".into(),
        r.sweep_id.clone().map(Value::String).unwrap_or(Value::Null),
    );
    Ok((m, last))
}

/// A run's main validation metric: the first `val/test_score/*` (by name), else
/// `val/test_score`, else `val/loss`; its key and final value.
pub fn main_metric(table: &BTreeMap<String, Value>) -> Option<(String, f64)> {
    let pick = |k: &String| table.get(k).and_then(Value::as_f64).map(|v| (k.clone(), v));
    table
        .keys()
        .filter(|k| k.starts_with("val/test_score/"))
        .find_map(pick)
        .or_else(|| pick(&"val/test_score".to_string()))
        .or_else(|| pick(&"val/loss".to_string()))
}

/// Seconds from a run's (last) start to its end, or to its last heartbeat while it runs.
pub fn duration_s(r: &RunRow) -> Option<f64> {
    r.started.map(|s| r.ended.or(r.heartbeat).unwrap_or(s) - s)
}

/// `1h02m`, `3m05s`, `12s`.
pub fn fmt_duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// A filter compares a key no listed run has: a typo, not an empty list.
#[derive(Debug)]
pub struct UnknownFilterKey {
    /// The key.
    pub key: String,
    /// The nearest key that exists.
    pub nearest: Option<String>,
}

impl std::fmt::Display for UnknownFilterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no run has `{}` (a config key, final metric or run field)",
            self.key
        )?;
        match &self.nearest {
            Some(n) => write!(f, "; did you mean `{n}`?"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for UnknownFilterKey {}

/// An [`UnknownFilterKey`] for the first key `expr` compares that no listed run has (`keys`:
/// every key of every run); fine when there are no runs at all.
pub fn check_filter_keys(
    expr: &filter::Expr,
    keys: &BTreeSet<String>,
) -> Result<(), UnknownFilterKey> {
    if keys.is_empty() {
        return Ok(());
    }
    let known: Vec<String> = keys.iter().cloned().collect();
    match expr
        .comparisons()
        .into_iter()
        .find(|(k, _)| !keys.contains(*k))
    {
        Some((key, _)) => Err(UnknownFilterKey {
            key: key.to_string(),
            nearest: crate::suggest::nearest_key(key, &known),
        }),
        None => Ok(()),
    }
}

/// A run with what a listing shows of it.
#[derive(Debug, Clone)]
pub struct Listed {
    /// The run.
    pub run: RunRow,
    /// What `--filter` sees of it ([`lookup_table`]).
    pub table: BTreeMap<String, Value>,
    /// The last step it recorded a metric at (`None`: none yet).
    pub last_step: Option<i64>,
}

/// The runs of `runs` that `expr` keeps (all of them without one), in order, each with its
/// lookup table. A key `expr` compares that no run has is an [`UnknownFilterKey`] under the
/// context `what` (the option or box the filter came from).
pub async fn filtered(
    store: &Store,
    runs: Vec<RunRow>,
    expr: Option<&filter::Expr>,
    what: &'static str,
) -> Result<Vec<Listed>> {
    let mut listed = Vec::new();
    let mut keys = BTreeSet::new();
    for run in runs {
        let (table, last_step) = lookup_table(store, &run).await?;
        keys.extend(table.keys().cloned());
        listed.push(Listed {
            run,
            table,
            last_step,
        });
    }
    if let Some(e) = expr {
        check_filter_keys(e, &keys).context(what)?;
        listed.retain(|l| e.eval(&|k| l.table.get(k).cloned()));
    }
    Ok(listed)
}

/// One group of a run's resolved config (`trainer`, `algorithm`, `actor_rollout_ref`, ...).
#[derive(Debug, Clone)]
pub struct ConfigGroup {
    /// The group's key.
    pub name: String,
    /// Its resolved values.
    pub table: toml::Value,
    /// Whether the run left it at the defaults (most such groups are ones its trainer never
    /// reads); `trainer` never counts as one.
    pub at_default: bool,
}

/// A run's resolved config, by group, in the config's order.
pub fn config_groups(r: &RunRow) -> Result<Vec<ConfigGroup>> {
    let cfg: config::ExperimentConfig = config::from_stored(&r.config, &[])
        .with_context(|| format!("the stored config of run {}", r.id))?;
    let table: toml::Table = toml::from_str(&config::to_toml(&cfg)?)?;
    let defaults: toml::Table =
        toml::from_str(&config::to_toml(&config::ExperimentConfig::default())?)?;
    Ok(table
        .into_iter()
        .map(|(name, table)| ConfigGroup {
            at_default: name != "trainer" && defaults.get(&name) == Some(&table),
            name,
            table,
        })
        .collect())
}
