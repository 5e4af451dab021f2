//! A small client for MLflow's REST API (`/api/2.0/mlflow/...`): the calls the outbox pushes
//! with, and the reads that make each push idempotent (which params a run already has, whether
//! a run with a given tag exists, whether a metric value already landed).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{Value, json};

/// A failed call: transient ones are retried, permanent ones are recorded and skipped.
#[derive(Debug)]
pub(super) struct CallError {
    pub(super) permanent: bool,
    pub(super) message: String,
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
pub(super) struct MlflowClient {
    http: reqwest::Client,
    base: String,
}

impl MlflowClient {
    /// A client for `uri` with a per-request timeout.
    pub(super) fn new(uri: &str, timeout: Duration) -> Result<MlflowClient> {
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

    pub(super) async fn post(&self, endpoint: &str, body: Value) -> Result<Value, CallError> {
        self.call(reqwest::Method::POST, endpoint, Some(body), &[])
            .await
    }

    /// The id of the experiment named `name`, created if needed.
    pub(super) async fn experiment_id(&self, name: &str) -> Result<String, CallError> {
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

/// MLflow's JSON takes non-finite doubles as strings.
pub(super) fn metric_value(v: f64) -> Value {
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

impl MlflowClient {
    async fn get(&self, endpoint: &str, query: &[(&str, &str)]) -> Result<Value, CallError> {
        self.call(reqwest::Method::GET, endpoint, None, query).await
    }

    /// The params the remote run already has.
    pub(super) async fn run_params(
        &self,
        rid: &str,
    ) -> Result<BTreeMap<String, String>, CallError> {
        let v = self.get("runs/get", &[("run_id", rid)]).await?;
        Ok(v.pointer("/run/data/params")
            .and_then(Value::as_array)
            .map(|ps| {
                ps.iter()
                    .filter_map(|p| {
                        Some((
                            p["key"].as_str()?.to_owned(),
                            p["value"].as_str().unwrap_or("").to_owned(),
                        ))
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Uploads `bytes` as artifact `path` of run `rid`, through the server's artifact proxy
    /// (`mlflow-artifacts`; `mlflow server` serves it by default). PUT overwrites, so a retry
    /// after a lost answer stores the same file once.
    pub(super) async fn put_artifact(
        &self,
        rid: &str,
        path: &str,
        bytes: Vec<u8>,
    ) -> Result<(), CallError> {
        let v = self.get("runs/get", &[("run_id", rid)]).await?;
        let root = v
            .pointer("/run/info/artifact_uri")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let Some(rel) = root.strip_prefix("mlflow-artifacts:") else {
            return Err(CallError {
                permanent: true,
                message: format!(
                    "run {rid} keeps its artifacts at {root:?}, which the server does not proxy \
                     (start `mlflow server` with --serve-artifacts)"
                ),
            });
        };
        let base = self.base.trim_end_matches("/api/2.0/mlflow");
        let url = format!(
            "{base}/api/2.0/mlflow-artifacts/artifacts/{}/{path}",
            rel.trim_matches('/')
        );
        let resp = self
            .http
            .put(&url)
            .header("content-type", "application/json")
            .body(bytes)
            .send()
            .await
            .map_err(|e| CallError {
                permanent: false,
                message: format!("{url}: {e}"),
            })?;
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        let text = resp.text().await.unwrap_or_default();
        Err(CallError {
            permanent: status.is_client_error() && status.as_u16() != 429 && status.as_u16() != 408,
            message: format!(
                "{url}: HTTP {status}: {}",
                text.chars().take(300).collect::<String>()
            ),
        })
    }

    /// The id of the active run of experiment `exp` whose tag `key` is `value`, if one exists.
    pub(super) async fn find_run_by_tag(
        &self,
        exp: &str,
        key: &str,
        value: &str,
    ) -> Result<Option<String>, CallError> {
        let filter = format!("tags.`{key}` = '{}'", value.replace('\'', "\\'"));
        let v = self
            .post(
                "runs/search",
                json!({"experiment_ids": [exp], "filter": filter, "max_results": 1}),
            )
            .await?;
        Ok(v.pointer("/runs/0/info/run_id")
            .and_then(Value::as_str)
            .map(str::to_owned))
    }

    /// Whether metric `key` of run `rid` has a value at `step` logged at `timestamp` (ms): how a
    /// batch whose answer never came back is told apart from one the server never took.
    pub(super) async fn has_metric(
        &self,
        rid: &str,
        key: &str,
        step: i64,
        timestamp: i64,
    ) -> Result<bool, CallError> {
        let mut token = String::new();
        loop {
            let mut query = vec![
                ("run_id", rid),
                ("metric_key", key),
                ("max_results", "25000"),
            ];
            if !token.is_empty() {
                query.push(("page_token", token.as_str()));
            }
            let v = self.get("metrics/get-history", &query).await?;
            let found = v["metrics"].as_array().is_some_and(|ms| {
                ms.iter().any(|m| {
                    m["step"].as_i64().unwrap_or(0) == step
                        && m["timestamp"].as_i64() == Some(timestamp)
                })
            });
            if found {
                return Ok(true);
            }
            match v["next_page_token"].as_str() {
                Some(t) if !t.is_empty() => token = t.to_owned(),
                _ => return Ok(false),
            }
        }
    }
}
