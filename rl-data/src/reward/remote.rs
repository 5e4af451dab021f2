//! OpenRLHF-style remote rewards (`reward.remote_url`): every row is scored by an HTTP server,
//! in batches of `reward.remote_batch_size` rows per `POST`.
//!
//! The request is a JSON object of parallel lists, OpenRLHF's `query` (prompt + response),
//! `prompts` and `labels` (the ground truths) plus `responses`, `data_sources` and `extra_info`;
//! the answer is `{"rewards": [number, ...]}`, one per row, in order (other keys are ignored).
//! A connection that fails or times out is tried three times in all; an HTTP error status fails
//! at once with the server's own text; an answer that is not such an object is an error
//! quoting it. Plain `http://` only: this crate is built without TLS.

use std::time::Duration;

use serde_json::{Value, json};

use super::{RewardFn, RewardOutput, ScoreRow};
use crate::error::{Error, Result};

/// Tries per request when the connection fails or times out.
const TRIES: usize = 3;

/// A client of one remote scorer.
#[derive(Debug, Clone)]
pub struct RemoteScorer {
    url: String,
    batch_size: usize,
    client: reqwest::blocking::Client,
}

impl RemoteScorer {
    /// A scorer at `url`, sending `batch_size` rows per request, each allowed `timeout_s`.
    pub fn new(url: &str, batch_size: usize, timeout_s: f64) -> Result<Self> {
        let bad = |key: &str, message: String| Error::Config {
            key: key.into(),
            message,
        };
        if !url.starts_with("http://") {
            return Err(bad(
                "reward.remote_url",
                format!("`{url}` must be an http:// URL (https is not built in)"),
            ));
        }
        if batch_size == 0 {
            return Err(bad("reward.remote_batch_size", "must be at least 1".into()));
        }
        if !(timeout_s > 0.0 && timeout_s.is_finite()) {
            return Err(bad(
                "reward.remote_timeout_s",
                format!("must be a positive number of seconds, got {timeout_s}"),
            ));
        }
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs_f64(timeout_s))
            .build()
            .map_err(|e| {
                bad(
                    "reward.remote_url",
                    format!("cannot build an HTTP client: {e}"),
                )
            })?;
        Ok(Self {
            url: url.to_string(),
            batch_size,
            client,
        })
    }

    fn error(&self, message: String) -> Error {
        Error::RemoteReward {
            url: self.url.clone(),
            message,
        }
    }

    fn post(&self, rows: &[ScoreRow<'_>]) -> Result<Vec<f64>> {
        let body = json!({
            "query": rows.iter().map(|r| format!("{}{}", r.prompt, r.response)).collect::<Vec<_>>(),
            "prompts": rows.iter().map(|r| r.prompt).collect::<Vec<_>>(),
            "responses": rows.iter().map(|r| r.response).collect::<Vec<_>>(),
            "labels": rows.iter().map(|r| r.ground_truth).collect::<Vec<_>>(),
            "data_sources": rows.iter().map(|r| r.data_source).collect::<Vec<_>>(),
            "extra_info": rows.iter().map(|r| r.extra_info).collect::<Vec<_>>(),
        });
        let mut last = String::new();
        for attempt in 0..TRIES {
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis(500 << attempt));
            }
            let resp = match self.client.post(&self.url).json(&body).send() {
                Ok(r) => r,
                Err(e) => {
                    last = format!("{e}");
                    continue;
                }
            };
            let status = resp.status();
            let text = resp
                .text()
                .map_err(|e| self.error(format!("reading the answer: {e}")))?;
            if !status.is_success() {
                return Err(self.error(format!("answered {status}: {}", clip(&text))));
            }
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| self.error(format!("answered {:?}, not JSON ({e})", clip(&text))))?;
            let rewards = v.get("rewards").and_then(Value::as_array).ok_or_else(|| {
                self.error(format!(
                    "answered {}, which has no `rewards` list",
                    clip(&text)
                ))
            })?;
            if rewards.len() != rows.len() {
                return Err(self.error(format!(
                    "answered {} rewards for {} rows",
                    rewards.len(),
                    rows.len()
                )));
            }
            return rewards
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    r.as_f64().ok_or_else(|| {
                        self.error(format!(
                            "reward {i} (data_source `{}`) is {r}, not a number",
                            rows[i].data_source
                        ))
                    })
                })
                .collect();
        }
        Err(self.error(format!("no answer after {TRIES} tries: {last}")))
    }
}

fn clip(s: &str) -> String {
    const MAX: usize = 2000;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

impl RewardFn for RemoteScorer {
    fn score(
        &self,
        response: &str,
        ground_truth: &Value,
        extra_info: &Value,
    ) -> Result<RewardOutput> {
        let row = ScoreRow::of_response(response, ground_truth, extra_info);
        Ok(RewardOutput::new(self.post(&[row])?[0]))
    }

    fn score_batch(&self, rows: &[ScoreRow<'_>]) -> Result<Vec<RewardOutput>> {
        let mut out = Vec::with_capacity(rows.len());
        for chunk in rows.chunks(self.batch_size) {
            out.extend(self.post(chunk)?.into_iter().map(RewardOutput::new));
        }
        Ok(out)
    }
}
