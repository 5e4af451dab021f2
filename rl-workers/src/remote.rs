//! Rollout on external OpenAI-compatible servers (`actor_rollout_ref.rollout.server_url`):
//! `harness serve`, or SGLang, which speaks the same weight-sync route (issue 23).
//!
//! Each prompt is one `POST /v1/completions` with its token ids, `n` samples, the rollout's
//! sampling settings, the generation's seed and `stream_offset` = the prompt's first output row
//! (so `harness serve` samples exactly the rows the in-process engine would), the stop tokens
//! as `stop_token_ids` with `ignore_eos`, and `return_token_ids` + `logprobs`: the rows come
//! back as token ids with their log-probs (the `rollout_log_probs`). Prompts go to the servers
//! round-robin, a few at a time.
//!
//! Before a step's generation the policy's weights are written as a Hugging Face folder
//! ([`CausalLm::save_pretrained`]) and every server loads it (`POST /update_weights_from_disk`);
//! the checksum each answers must equal [`CausalLm::weights_sha256`], or the step fails. Every
//! call has a timeout, and an error carries the server's own text.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::heads::CausalLm;
use crate::rollout::RolloutConfig;

/// Requests in flight at once, over all servers.
const CONCURRENCY: usize = 16;

/// One output row: the response's token ids and their log-probs.
pub type Row = (Vec<i64>, Vec<f32>);

/// The client of the rollout servers.
#[derive(Debug)]
pub struct RemoteEngine {
    urls: Vec<String>,
    timeout: Duration,
    sync_dir: PathBuf,
    client: reqwest::blocking::Client,
}

fn remote_err(url: &str, what: &str, message: impl std::fmt::Display) -> Error {
    Error::invalid("server_url", format!("{url}: {what}: {message}"))
}

impl RemoteEngine {
    /// A client of `cfg.server_url` (at least one), writing weights into
    /// `cfg.weight_sync_dir` (default: a folder of this process under the temporary directory).
    pub fn new(cfg: &RolloutConfig) -> Result<RemoteEngine> {
        cfg.validate()?;
        if cfg.server_url.is_empty() {
            return Err(Error::invalid(
                "server_url",
                "no server to generate on".to_owned(),
            ));
        }
        let timeout = Duration::from_secs_f64(cfg.server_timeout_s);
        let client = reqwest::blocking::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| Error::invalid("server_url", format!("starting the HTTP client: {e}")))?;
        let sync_dir = cfg.weight_sync_dir.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("harness-weight-sync-{}", std::process::id()))
        });
        Ok(RemoteEngine {
            urls: cfg
                .server_url
                .iter()
                .map(|u| u.trim_end_matches('/').to_owned())
                .collect(),
            timeout,
            sync_dir,
            client,
        })
    }

    /// POSTs `body` to `url`, returning the JSON answer; a failure names the server, the
    /// route and carries the server's own text.
    fn post(&self, url: &str, route: &str, body: &Value) -> Result<Value> {
        let what = format!("POST {route}");
        let r = self
            .client
            .post(format!("{url}{route}"))
            .json(body)
            .send()
            .map_err(|e| {
                let why = if e.is_timeout() {
                    format!(
                        "no answer within {:?} (rollout.server_timeout_s)",
                        self.timeout
                    )
                } else {
                    e.to_string()
                };
                remote_err(url, &what, why)
            })?;
        let status = r.status();
        let text = r.text().map_err(|e| remote_err(url, &what, e))?;
        if !status.is_success() {
            return Err(remote_err(url, &what, format!("{status}: {text}")));
        }
        serde_json::from_str(&text)
            .map_err(|e| remote_err(url, &what, format!("not JSON ({e}): {text}")))
    }

    /// Writes `lm`'s weights and has every server load them, checking each one's checksum.
    pub fn sync(&self, lm: &CausalLm) -> Result<()> {
        lm.save_pretrained(&self.sync_dir)?;
        let want = lm.weights_sha256();
        let dir = std::path::absolute(&self.sync_dir).unwrap_or_else(|_| self.sync_dir.clone());
        for url in &self.urls {
            let r = self.post(
                url,
                "/update_weights_from_disk",
                &json!({"model_path": dir}),
            )?;
            if r["success"] != json!(true) {
                return Err(remote_err(url, "POST /update_weights_from_disk", r));
            }
            match r["weights_sha256"].as_str() {
                Some(got) if got == want => {}
                Some(got) => {
                    return Err(remote_err(
                        url,
                        "weight sync",
                        format!(
                            "the server holds weights of checksum {got}, the policy's is {want}"
                        ),
                    ));
                }
                // a server without our checksum (SGLang): its own success is all there is
                None => {}
            }
        }
        Ok(())
    }

    /// `cfg.n` samples of each prompt (real token ids, no padding) with `seed`, stopping at
    /// `eos`: per output row (prompt-major, the `n` samples of a prompt together), the response
    /// tokens and their log-probs. `row_offset` is the first row's global index (a
    /// data-parallel rank's share).
    pub fn generate(
        &self,
        prompts: &[Vec<i64>],
        cfg: &RolloutConfig,
        seed: u64,
        row_offset: u64,
        eos: &[i64],
    ) -> Result<Vec<Row>> {
        let n = cfg.n;
        let sampling = cfg.sampling();
        let body = |p: usize| {
            json!({
                "prompt": prompts[p],
                "n": n,
                "max_tokens": cfg.response_length,
                "temperature": if sampling { cfg.temperature } else { 0.0 },
                "top_p": cfg.top_p,
                "top_k": cfg.top_k,
                "seed": seed,
                "stream_offset": row_offset + (p * n) as u64,
                "stop_token_ids": eos,
                "ignore_eos": true,
                "logprobs": 1,
                "return_token_ids": true,
            })
        };
        let mut rows: Vec<Option<Result<Vec<Row>>>> = (0..prompts.len()).map(|_| None).collect();
        for start in (0..prompts.len()).step_by(CONCURRENCY) {
            let end = (start + CONCURRENCY).min(prompts.len());
            std::thread::scope(|s| {
                let handles: Vec<_> = (start..end)
                    .map(|p| {
                        let url = &self.urls[p % self.urls.len()];
                        let body = body(p);
                        s.spawn(move || {
                            let r = self.post(url, "/v1/completions", &body)?;
                            parse_choices(url, &r, n)
                        })
                    })
                    .collect();
                for (p, h) in (start..end).zip(handles) {
                    rows[p] = Some(h.join().unwrap_or_else(|_| {
                        Err(Error::invalid(
                            "server_url",
                            "a request thread panicked".to_owned(),
                        ))
                    }));
                }
            });
        }
        let mut out = Vec::with_capacity(prompts.len() * n);
        for r in rows {
            out.extend(r.unwrap_or_else(|| {
                Err(Error::invalid(
                    "server_url",
                    "a prompt was never sent".to_owned(),
                ))
            })?);
        }
        Ok(out)
    }
}

/// The `n` choices of one answer in order: token ids and their log-probs.
fn parse_choices(url: &str, r: &Value, n: usize) -> Result<Vec<Row>> {
    let bad = |m: String| remote_err(url, "POST /v1/completions", m);
    let choices = r["choices"]
        .as_array()
        .ok_or_else(|| bad(format!("no `choices` in {r}")))?;
    if choices.len() != n {
        return Err(bad(format!("{} choices for n = {n}", choices.len())));
    }
    let mut out: Vec<(usize, Vec<i64>, Vec<f32>)> = choices
        .iter()
        .map(|c| {
            let index = c["index"].as_u64().unwrap_or(0) as usize;
            let ids: Option<Vec<i64>> = c["token_ids"]
                .as_array()
                .and_then(|a| a.iter().map(Value::as_i64).collect());
            let lps: Option<Vec<f32>> = c["logprobs"]["token_logprobs"]
                .as_array()
                .and_then(|a| a.iter().map(|v| v.as_f64().map(|x| x as f32)).collect());
            match (ids, lps) {
                (Some(i), Some(l)) if i.len() == l.len() => Ok((index, i, l)),
                _ => Err(bad(format!(
                    "choice {index} lacks `token_ids` and `logprobs.token_logprobs` of one length (the server must support vLLM's `return_token_ids`): {c}"
                ))),
            }
        })
        .collect::<Result<_>>()?;
    out.sort_by_key(|(i, _, _)| *i);
    Ok(out.into_iter().map(|(_, i, l)| (i, l)).collect())
}
