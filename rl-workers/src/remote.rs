//! Rollout on external OpenAI-compatible servers (`actor_rollout_ref.rollout.server_url`):
//! `harness serve`, vLLM or SGLang (issue 23).
//!
//! Each prompt is one `POST /v1/completions` with its token ids, `n` samples, the rollout's
//! sampling settings, the generation's seed and `stream_offset` = the prompt's first output row
//! (so `harness serve` samples exactly the rows the in-process engine would), the stop tokens
//! as `stop_token_ids` with `ignore_eos`, and `return_token_ids` + `logprobs`: the rows come
//! back as token ids with their log-probs (the `rollout_log_probs`). Prompts go to the servers
//! round-robin, a few at a time.
//!
//! Before a step's generation the policy's weights are written as a Hugging Face folder
//! ([`CausalLm::save_pretrained`]) and every server loads it, through the API
//! `rollout.name` names:
//! - `vllm`: vLLM's RL control plane with its `disk` data plane: `/init_weight_transfer_engine`
//!   (once), `/pause?mode=wait`, `/start_weight_update`, `/update_weights` with
//!   `{"update_info": {"path": DIR}}`, `/finish_weight_update` with the step as
//!   `weight_version`, `/resume`, then `/weight_checker`'s per-tensor SHA-256 digests compared
//!   with those of the tensors written ([`folder_digests`]);
//! - `sglang`: `/update_weights_from_disk`, whose answer from `harness serve` carries
//!   [`CausalLm::weights_sha256`], compared with the policy's.
//!
//! A mismatch fails the step. Every call has a timeout, and an error names the server and the
//! route and carries the server's own text.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
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
    /// vLLM's API (`rollout.name = "vllm"`), else SGLang's.
    vllm: bool,
    /// Per server: `/init_weight_transfer_engine` was called (vLLM).
    initialized: Vec<bool>,
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
            vllm: cfg.name != "sglang",
            initialized: vec![false; cfg.server_url.len()],
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

    /// Writes `lm`'s weights and has every server load them, checking what each one holds;
    /// `version` is the weight version vLLM records (the step).
    pub fn sync(&mut self, lm: &CausalLm, version: u64) -> Result<()> {
        if lm.export_unties_head() {
            return Err(Error::invalid(
                "actor_rollout_ref.model.target_modules",
                "`lm_head` or `embed_tokens` of a model whose head is tied to its embedding: the \
                 merged weights give the head a weight of its own, which a server holding the \
                 tied model cannot load; leave them out or use the built-in rollout"
                    .to_owned(),
            ));
        }
        lm.save_pretrained(&self.sync_dir)?;
        let dir = std::path::absolute(&self.sync_dir).unwrap_or_else(|_| self.sync_dir.clone());
        if self.vllm {
            let want = folder_digests(&dir)?;
            for i in 0..self.urls.len() {
                self.sync_vllm(i, &dir, version, &want)?;
            }
            return Ok(());
        }
        let want = lm.weights_sha256();
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

    /// vLLM's sequence on server `i`: pause (letting running requests finish), one
    /// start/update/finish session loading `dir`, resume, then the weight checker's digests
    /// against `want`. A failure inside the session closes it and resumes the server before
    /// the error is returned.
    fn sync_vllm(
        &mut self,
        i: usize,
        dir: &Path,
        version: u64,
        want: &BTreeMap<String, Digests>,
    ) -> Result<()> {
        let url = self.urls[i].clone();
        if !self.initialized[i] {
            // the disk data plane needs no rendezvous: its init info is empty
            self.post(
                &url,
                "/init_weight_transfer_engine",
                &json!({"init_info": {}}),
            )?;
            self.initialized[i] = true;
        }
        self.post(&url, "/pause?mode=wait", &json!({}))?;
        let session = (|| {
            // `is_checkpoint_format`: read by vLLM up to 0.2x, ignored since
            self.post(
                &url,
                "/start_weight_update",
                &json!({"is_checkpoint_format": true}),
            )?;
            let loaded = self
                .post(
                    &url,
                    "/update_weights",
                    &json!({"update_info": {"path": dir}}),
                )
                .and_then(|_| {
                    self.post(
                        &url,
                        "/finish_weight_update",
                        &json!({"weight_version": version.to_string()}),
                    )
                });
            if loaded.is_err() {
                // closes a session the failure left open (an error here is expected: the
                // first one is the one to report)
                let _ = self.post(&url, "/finish_weight_update", &json!({}));
            }
            loaded
        })();
        let resumed = self.post(&url, "/resume", &json!({}));
        session?;
        resumed?;
        let r = self.post(&url, "/weight_checker", &json!({"action": "checksum"}))?;
        check_digests(&url, &r, want)
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

/// The SHA-256 digests a tensor written to the sync folder may have on a server: of its bytes
/// as written, and (float32 tensors) of its values rounded to bfloat16 and to float16, the
/// dtypes a server may hold it in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digests {
    /// Of the bytes as written.
    pub written: String,
    /// Of the bfloat16 and float16 roundings (float32 tensors only).
    pub rounded: Vec<String>,
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!("{:x}", Sha256::digest(bytes))
}

/// vLLM's weight-checker digest (SHA-256 of a tensor's raw bytes) of every tensor of the
/// safetensors files in `dir`, by name, with those of its bfloat16 and float16 roundings.
pub fn folder_digests(dir: &Path) -> Result<BTreeMap<String, Digests>> {
    let io =
        |e: std::io::Error| Error::invalid("weight_sync_dir", format!("{}: {e}", dir.display()));
    let mut out = BTreeMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(std::result::Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    for f in files {
        let bytes = std::fs::read(&f).map_err(io)?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| Error::invalid("weight_sync_dir", format!("{}: {e}", f.display())))?;
        for (name, view) in st.tensors() {
            let data = view.data();
            let rounded = if view.dtype() == safetensors::Dtype::F32 {
                let values = data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                let bf16: Vec<u8> = values
                    .clone()
                    .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
                    .collect();
                let f16: Vec<u8> = values
                    .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
                    .collect();
                vec![sha256_hex(&bf16), sha256_hex(&f16)]
            } else {
                Vec::new()
            };
            out.insert(
                name,
                Digests {
                    written: sha256_hex(data),
                    rounded,
                },
            );
        }
    }
    if out.is_empty() {
        return Err(Error::invalid(
            "weight_sync_dir",
            format!("{}: no safetensors tensors were written", dir.display()),
        ));
    }
    Ok(out)
}

/// Checks `/weight_checker`'s answer (`{"checksums": {"dp0:pp0:pcp0:tp0:ep0:NAME": hex}}`)
/// against the written tensors' digests: every tensor both name must match (a server holding
/// it in bfloat16 or float16 matches its rounding). Tensors only the server names (vLLM's fused
/// `qkv_proj`, `gate_up_proj`) cannot be compared and are skipped, but at least one must be
/// compared; a tensor reported by several ranks (sharded by tensor parallelism) cannot be
/// compared either.
fn check_digests(url: &str, r: &Value, want: &BTreeMap<String, Digests>) -> Result<()> {
    let what = "POST /weight_checker";
    let Some(got) = r["checksums"].as_object() else {
        return Err(remote_err(
            url,
            what,
            format!("no `checksums` object in {r}"),
        ));
    };
    let mut by_name: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (key, digest) in got {
        let name = key.rsplit(':').next().unwrap_or(key);
        let Some(d) = digest.as_str() else {
            return Err(remote_err(
                url,
                what,
                format!("digest of {key} is not a string: {digest}"),
            ));
        };
        by_name.entry(name).or_default().push(d);
    }
    let mut compared = 0;
    for (name, digests) in &by_name {
        let (Some(w), [d]) = (want.get(*name), digests.as_slice()) else {
            continue;
        };
        if *d != w.written && !w.rounded.iter().any(|r| r == d) {
            return Err(remote_err(
                url,
                "weight sync",
                format!(
                    "the server's {name} has digest {d}, the synced folder's is {} (float32): the server does not hold the weights just written",
                    w.written
                ),
            ));
        }
        compared += 1;
    }
    if compared == 0 {
        let some: Vec<&&str> = by_name.keys().take(4).collect();
        return Err(remote_err(
            url,
            "weight sync",
            format!(
                "the weight checker's {} tensors (e.g. {some:?}) include none of the {} written, on one rank each: nothing to verify the sync by",
                by_name.len(),
                want.len()
            ),
        ));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn want() -> BTreeMap<String, Digests> {
        let values: Vec<u8> = [1.0f32, 0.1, -3.3]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let bf16: Vec<u8> = [1.0f32, 0.1, -3.3]
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        BTreeMap::from([(
            "model.norm.weight".to_owned(),
            Digests {
                written: sha256_hex(&values),
                rounded: vec![sha256_hex(&bf16)],
            },
        )])
    }

    #[test]
    fn the_checker_must_hold_the_written_tensors() {
        let w = want();
        let d = &w["model.norm.weight"];
        let answer = |digest: &str| {
            json!({"checksums": {
                "dp0:pp0:pcp0:tp0:ep0:model.norm.weight": digest,
                // fused by vLLM: not comparable, skipped
                "dp0:pp0:pcp0:tp0:ep0:model.layers.0.self_attn.qkv_proj.weight": "ab",
            }})
        };
        check_digests("http://s", &answer(&d.written), &w).unwrap();
        // a server holding the tensor in bfloat16
        check_digests("http://s", &answer(&d.rounded[0]), &w).unwrap();
        // a sync that did not land (the old weights)
        let e = check_digests("http://s", &answer("00ff"), &w)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("http://s") && e.contains("model.norm.weight") && e.contains("00ff"),
            "{e}"
        );
        // nothing to compare by
        let e = check_digests(
            "http://s",
            &json!({"checksums": {"dp0:pp0:pcp0:tp0:ep0:other": "00"}}),
            &w,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("nothing to verify"), "{e}");
        let e = check_digests("http://s", &json!({"status": "reset"}), &w)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/weight_checker") && e.contains("checksums"),
            "{e}"
        );
    }

    #[test]
    fn rollout_name_is_checked() {
        let cfg = |name: &str, url: &[&str]| RolloutConfig {
            name: name.to_owned(),
            server_url: url.iter().map(|s| s.to_string()).collect(),
            ..RolloutConfig::default()
        };
        assert_eq!(RolloutConfig::default().name, "vllm");
        cfg("sglang", &["http://x"]).validate().unwrap();
        cfg("hf", &[]).validate().unwrap();
        let e = cfg("trtllm", &[]).validate().unwrap_err().to_string();
        assert!(
            e.contains("name") && e.contains("trtllm") && e.contains("vllm, sglang, hf"),
            "{e}"
        );
        let e = cfg("hf", &["http://x"]).validate().unwrap_err().to_string();
        assert!(e.contains("name") && e.contains("in-process"), "{e}");
    }

    /// A server holding a model whose head is tied to its embedding cannot load a merged
    /// export that unties them: refused by key before anything is written or sent.
    #[test]
    fn an_untied_merge_is_refused_before_any_request() {
        let dir = tempfile::tempdir().unwrap();
        let mut engine = RemoteEngine::new(&RolloutConfig {
            name: "sglang".to_owned(),
            // nothing listens there: the refusal comes first
            server_url: vec!["http://127.0.0.1:9".to_owned()],
            weight_sync_dir: Some(dir.path().join("sync")),
            ..RolloutConfig::default()
        })
        .unwrap();
        let mut cfg = crate::Config::tiny();
        cfg.tie_word_embeddings = true;
        for target in ["lm_head", "embed_tokens"] {
            let mut lm = CausalLm::new(&cfg, tch::Device::Cpu, tch::Kind::Float).unwrap();
            lm.add_lora(&crate::LoraConfig {
                rank: 2,
                alpha: 4.0,
                target_modules: crate::TargetModules::Names(vec![target.to_owned()]),
                exclude_modules: Vec::new(),
                dropout: 0.0,
                use_rslora: false,
            })
            .unwrap();
            let e = engine.sync(&lm, 1).unwrap_err().to_string();
            assert!(e.contains("target_modules") && e.contains("tied"), "{e}");
            assert!(!dir.path().join("sync").exists());
        }
    }
}
