//! vLLM's RL control plane on `harness serve` (vLLM's `entrypoints/serve/dev/rlhf/api_router.py`,
//! served there under `VLLM_SERVER_DEV_MODE=1`): pause and resume generation, the weight-transfer
//! session (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
//! `/finish_weight_update`) over vLLM's `disk` data plane (`update_info = {"path": DIR}`: a
//! safetensors folder loaded in place), the weight version, and `/weight_checker`'s per-tensor
//! SHA-256 digests. docs/serving.md lists the routes, their bodies and where we differ.
//!
//! The handlers check the bodies (a 400 naming the field) and hand the engine thread an [`Op`];
//! the engine thread owns the [`Session`] (the weight-transfer state machine: an update outside
//! a started session, a second checkpoint in one session, a finish with nothing loaded are 409s
//! with vLLM's own messages) and the pause state, so an op sees the weights and the batch as
//! they are between two decode steps.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use http_body_util::BodyExt;
use hyper::{Method, StatusCode};
use rl_workers::CausalLm;
use serde_json::{Map, Value, json};
use tch::{Device, Kind};
use tokio::sync::oneshot;

use super::State;
use super::http::Reply;
use super::worker::Msg;

/// The only rank of a `harness serve` process, as vLLM prefixes its checksum keys
/// (`dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:ep{ep}:`).
pub(crate) const RANK_PREFIX: &str = "dp0:pp0:pcp0:tp0:ep0:";

/// What `POST /pause?mode=` does with the requests in flight (vLLM's `PauseMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PauseMode {
    /// Every request in flight (running or queued) ends at once with `finish_reason: "abort"`
    /// and the tokens it had (vLLM's default).
    Abort,
    /// The running samples finish; the pause answers once none runs.
    Wait,
    /// The running samples are frozen where they are and go on after `/resume`.
    Keep,
}

/// A control-plane operation for the engine thread.
#[derive(Debug)]
pub(crate) enum Op {
    Pause(PauseMode),
    Resume,
    IsPaused,
    Init(Map<String, Value>),
    Start,
    Update(Value),
    Finish(Option<String>),
    SetVersion(String),
    Version,
    Checksum,
    Compare {
        baseline: Map<String, Value>,
        others: Vec<Map<String, Value>>,
    },
    Reset,
}

/// An op's answer: the JSON body, or the status and message of its error.
pub(crate) type OpReply = Result<Value, (StatusCode, String)>;

fn conflict(m: impl Into<String>) -> (StatusCode, String) {
    (StatusCode::CONFLICT, m.into())
}

fn bad(m: impl Into<String>) -> (StatusCode, String) {
    (StatusCode::BAD_REQUEST, m.into())
}

/// The weight-transfer state of the served model (the `disk` backend's session: vLLM's
/// `DiskWeightTransferEngine`), and its weight version.
#[derive(Debug, Default)]
pub(crate) struct Session {
    /// `/start_weight_update` was called and `/finish_weight_update` not yet.
    active: bool,
    /// A checkpoint was loaded in the active session.
    loaded: bool,
    /// The last committed weight version (`/finish_weight_update`'s or
    /// `/update_weight_version`'s).
    version: Option<String>,
}

impl Session {
    /// Runs a weight-transfer or checker op (pause and resume are the engine loop's).
    pub(crate) fn apply(&mut self, lm: &CausalLm, op: Op) -> OpReply {
        match op {
            Op::Init(info) => {
                // the disk backend's init info has no fields: it needs no rendezvous
                if let Some(k) = info.keys().next() {
                    return Err(bad(format!(
                        "Invalid init_info for DiskWeightTransferEngine: unexpected field `init_info.{k}` (the disk backend takes no init fields: send {{\"init_info\": {{}}}})"
                    )));
                }
                Ok(json!({"message": "Weight transfer initialized"}))
            }
            Op::Start => {
                if self.active {
                    return Err(conflict(
                        "A shared-disk weight update is already active (call /finish_weight_update first)",
                    ));
                }
                self.active = true;
                self.loaded = false;
                Ok(json!({"message": "Weight update started"}))
            }
            Op::Update(info) => {
                if !self.active {
                    return Err(conflict(
                        "start_weight_update must be called before loading a checkpoint",
                    ));
                }
                if self.loaded {
                    self.abort();
                    return Err(conflict(
                        "The disk backend accepts exactly one checkpoint per update session",
                    ));
                }
                // as vLLM's disk backend, a failed update (a bad update_info included) ends the
                // session
                let dir = match disk_path(&info) {
                    Ok(d) => d,
                    Err(e) => {
                        self.abort();
                        return Err(bad(e));
                    }
                };
                if let Err(e) = lm.load_weights(&dir) {
                    self.abort();
                    return Err(bad(format!(
                        "loading the weights of {}: {e}",
                        dir.display()
                    )));
                }
                self.loaded = true;
                Ok(json!({"message": "Weights updated"}))
            }
            Op::Finish(version) => {
                if !self.active {
                    return Err(conflict("No shared-disk weight update is active"));
                }
                if !self.loaded {
                    self.abort();
                    return Err(conflict(
                        "No checkpoint was loaded during the shared-disk update session",
                    ));
                }
                self.abort();
                if version.is_some() {
                    self.version = version;
                }
                Ok(json!({"message": "Weight update finished"}))
            }
            Op::SetVersion(v) => {
                self.version = Some(v.clone());
                Ok(json!({"success": true, "new_version": v}))
            }
            Op::Version => Ok(json!({"weight_version": self.version})),
            Op::Checksum => Ok(json!({"checksums": checksums(lm)})),
            Op::Compare { baseline, others } => {
                let current: Map<String, Value> = checksums(lm)
                    .into_iter()
                    .map(|(k, v)| (k, Value::String(v)))
                    .collect();
                let mut reports = vec![baseline, current];
                reports.extend(others);
                let (matched, mismatches, ranks) = compare(&reports);
                Ok(json!({"match": matched, "mismatches": mismatches, "ranks": ranks}))
            }
            Op::Reset => {
                reset(lm);
                Ok(json!({"status": "reset"}))
            }
            Op::Pause(_) | Op::Resume | Op::IsPaused => {
                Err((StatusCode::INTERNAL_SERVER_ERROR, "not a session op".into()))
            }
        }
    }

    fn abort(&mut self) {
        self.active = false;
        self.loaded = false;
    }
}

/// vLLM's `DiskWeightTransferUpdateInfo`: `{"path": DIR}`, an absolute local folder holding
/// safetensors files.
fn disk_path(info: &Value) -> Result<std::path::PathBuf, String> {
    let Some(obj) = info.as_object() else {
        return Err(format!("`update_info` must be an object, got {info}"));
    };
    if let Some(k) = obj.keys().find(|k| k.as_str() != "path") {
        return Err(format!(
            "Invalid update_info for DiskWeightTransferEngine: unexpected field `update_info.{k}` (the disk backend takes {{\"path\": DIR}})"
        ));
    }
    let path = match obj.get("path") {
        Some(Value::String(p)) if !p.is_empty() => std::path::PathBuf::from(p),
        _ => {
            return Err("`update_info.path` must be a non-empty absolute local directory".into());
        }
    };
    if !path.is_absolute() {
        return Err(format!(
            "`update_info.path` must be an absolute local directory, got {}",
            path.display()
        ));
    }
    if !path.is_dir() {
        return Err(format!(
            "Shared-disk checkpoint path must be a local directory: {}",
            path.display()
        ));
    }
    let has_safetensors = std::fs::read_dir(&path)
        .map_err(|e| format!("reading {}: {e}", path.display()))?
        .filter_map(std::result::Result::ok)
        .any(|e| {
            e.file_name().to_string_lossy().ends_with(".safetensors")
                && e.file_type().is_ok_and(|t| t.is_file())
        });
    if !has_safetensors {
        return Err(format!(
            "Shared-disk checkpoint directory contains no safetensors files: {}",
            path.display()
        ));
    }
    Ok(path)
}

/// vLLM's weight checker digests: per tensor, SHA-256 of its raw bytes as held (the served
/// dtype, row-major), keyed `dp0:pp0:pcp0:tp0:ep0:NAME` with the Hugging Face tensor name (we
/// hold every tensor unfused and unsharded).
pub(crate) fn checksums(lm: &CausalLm) -> BTreeMap<String, String> {
    use sha2::{Digest, Sha256};
    lm.var_store()
        .variables()
        .into_iter()
        .map(|(name, t)| {
            let flat = t
                .detach()
                .to_device(Device::Cpu)
                .contiguous()
                .view([-1])
                .view_dtype(Kind::Uint8);
            let bytes = Vec::<u8>::try_from(&flat).unwrap_or_default();
            (
                format!("{RANK_PREFIX}{name}"),
                format!("{:x}", Sha256::digest(&bytes)),
            )
        })
        .collect()
}

/// vLLM's `compare_weight_checksum_reports`: every report held to every other; a key
/// mismatches when some report lacks it or holds another digest. The rank prefixes covered.
fn compare(reports: &[Map<String, Value>]) -> (bool, Vec<String>, Vec<String>) {
    let keys: BTreeSet<&String> = reports.iter().flat_map(|r| r.keys()).collect();
    let mismatches: Vec<String> = keys
        .iter()
        .filter(|k| {
            let first = reports[0].get(k.as_str());
            first.is_none() || reports.iter().any(|r| r.get(k.as_str()) != first)
        })
        .map(|k| (*k).clone())
        .collect();
    let ranks: BTreeSet<String> = keys
        .iter()
        .filter_map(|k| {
            let mut end = 0;
            for _ in 0..5 {
                end += k[end..].find(':')? + 1;
            }
            Some(k[..end].to_owned())
        })
        .collect();
    (
        mismatches.is_empty(),
        mismatches,
        ranks.into_iter().collect(),
    )
}

/// vLLM's `reset`: every checked tensor overwritten with uniform noise in place, so that a
/// later compare proves a transfer really wrote them.
fn reset(lm: &CausalLm) {
    // the noise comes from torch's global generator: draw it under the lock every seeded
    // model construction of the process holds (rl_workers::seed)
    let _generator = rl_workers::hold_generator();
    tch::no_grad(|| {
        for (_, mut t) in lm.var_store().variables() {
            let noise = t.rand_like();
            t.copy_(&noise);
        }
    });
}

/// vLLM's error body (`ErrorResponse`: the status's phrase as `type`, the status as `code`).
fn vllm_error(status: StatusCode, message: impl Into<String>) -> Reply {
    super::http::json_reply(
        status,
        &json!({"error": {
            "message": message.into(),
            "type": status.canonical_reason().unwrap_or("Error"),
            "param": null,
            "code": status.as_u16(),
        }}),
    )
}

/// The routes of this module; `None` for any other.
pub(crate) fn route(method: &Method, path: &str) -> Option<Route> {
    Some(match (method, path) {
        (&Method::POST, "/pause") => Route::Pause,
        (&Method::POST, "/resume") => Route::Resume,
        (&Method::GET, "/is_paused") => Route::IsPaused,
        (&Method::GET, "/is_sleeping") => Route::IsSleeping,
        (&Method::POST, "/init_weight_transfer_engine") => Route::Init,
        (&Method::POST, "/start_weight_update") => Route::Start,
        (&Method::POST, "/update_weights") => Route::Update,
        (&Method::POST, "/finish_weight_update") => Route::Finish,
        (&Method::POST, "/update_weight_version") => Route::SetVersion,
        (&Method::GET, "/weight_info") => Route::Version,
        (&Method::POST, "/weight_checker") => Route::Checker,
        (&Method::GET, "/get_world_size") => Route::WorldSize,
        _ => return None,
    })
}

/// One of vLLM's control-plane routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Pause,
    Resume,
    IsPaused,
    IsSleeping,
    Init,
    Start,
    Update,
    Finish,
    SetVersion,
    Version,
    Checker,
    WorldSize,
}

/// FastAPI's booleans in a query.
fn query_bool(name: &str, v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("query `{name}`: {v:?} is not a boolean")),
    }
}

/// `/pause`'s query: `mode` (abort | wait | keep, default abort), the deprecated
/// `wait_for_inflight_requests` (true = wait) and `clear_cache` (accepted: there is no prefix
/// cache to clear).
fn pause_mode(query: Option<&str>) -> Result<PauseMode, String> {
    let mut mode = PauseMode::Abort;
    let mut wait = false;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "mode" => {
                mode = match v {
                    "abort" => PauseMode::Abort,
                    "wait" => PauseMode::Wait,
                    "keep" => PauseMode::Keep,
                    other => {
                        return Err(format!(
                            "query `mode`: {other:?} is not one of abort, wait, keep"
                        ));
                    }
                }
            }
            "wait_for_inflight_requests" => wait = query_bool(k, v)?,
            "clear_cache" => {
                query_bool(k, v)?;
            }
            _ => {}
        }
    }
    Ok(if wait { PauseMode::Wait } else { mode })
}

/// The body as a JSON object; an empty body is `{}` when `empty_ok`.
fn object(body: &[u8], empty_ok: bool) -> Result<Map<String, Value>, String> {
    if body.iter().all(u8::is_ascii_whitespace) && empty_ok {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(format!("Expected a JSON object, got {other}")),
        Err(e) => Err(format!("Invalid JSON format: {e}")),
    }
}

fn optional_string(m: &Map<String, Value>, key: &str) -> Result<Option<String>, String> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!("`{key}` must be a string, got {other}")),
    }
}

/// The op a request asks for, its body checked: `Err` is the 400's message.
fn parse_op(route: Route, query: Option<&str>, body: &[u8]) -> Result<Op, String> {
    Ok(match route {
        Route::Pause => Op::Pause(pause_mode(query)?),
        Route::Resume => Op::Resume,
        Route::IsPaused => Op::IsPaused,
        Route::Version => Op::Version,
        Route::Init => {
            let m = object(body, false)?;
            match m.get("init_info") {
                None | Some(Value::Null) => {
                    return Err("Missing 'init_info' in request body".into());
                }
                Some(Value::Object(info)) => Op::Init(info.clone()),
                Some(other) => return Err(format!("`init_info` must be an object, got {other}")),
            }
        }
        Route::Start => {
            // vLLM up to 0.2x read `is_checkpoint_format`; a disk folder is always a checkpoint
            let m = object(body, true)?;
            match m.get("is_checkpoint_format") {
                None | Some(Value::Null | Value::Bool(true)) => Op::Start,
                Some(other) => {
                    return Err(format!(
                        "`is_checkpoint_format` {other}: the disk backend loads checkpoint-format folders only (true)"
                    ));
                }
            }
        }
        Route::Update => {
            let m = object(body, false)?;
            match m.get("update_info") {
                None | Some(Value::Null) => {
                    return Err("Missing 'update_info' in request body".into());
                }
                Some(info) => Op::Update(info.clone()),
            }
        }
        Route::Finish => Op::Finish(optional_string(&object(body, true)?, "weight_version")?),
        Route::SetVersion => {
            let m = object(body, false)?;
            match optional_string(&m, "new_version")? {
                Some(v) => Op::SetVersion(v),
                None => return Err("Missing 'new_version' in request body".into()),
            }
        }
        Route::Checker => {
            let m = object(body, false)?;
            match m.get("action").and_then(Value::as_str) {
                Some("checksum") => Op::Checksum,
                Some("reset") => Op::Reset,
                Some("compare") => {
                    let Some(Value::Object(baseline)) = m.get("baseline") else {
                        return Err("action='compare' requires a 'baseline' object".into());
                    };
                    let others = match m.get("checksums") {
                        None | Some(Value::Null) => Vec::new(),
                        Some(Value::Array(a)) => a
                            .iter()
                            .map(|r| r.as_object().cloned())
                            .collect::<Option<Vec<_>>>()
                            .ok_or("'checksums' must be a list of checksum response objects")?,
                        Some(_) => {
                            return Err(
                                "'checksums' must be a list of checksum response objects".into()
                            );
                        }
                    };
                    Op::Compare {
                        baseline: baseline.clone(),
                        others,
                    }
                }
                _ => {
                    return Err(format!(
                        "action must be one of checksum|reset|compare, got {}",
                        m.get("action").unwrap_or(&Value::Null)
                    ));
                }
            }
        }
        Route::IsSleeping | Route::WorldSize => {
            return Err("answered without the engine".into());
        }
    })
}

/// Answers one of vLLM's control-plane requests.
pub(crate) async fn handle(
    route: Route,
    req: hyper::Request<hyper::body::Incoming>,
    state: Arc<State>,
) -> Reply {
    match route {
        // the engine never sleeps (there is no /sleep); one process is one rank
        Route::IsSleeping => {
            return super::http::json_reply(StatusCode::OK, &json!({"is_sleeping": false}));
        }
        Route::WorldSize => {
            return super::http::json_reply(StatusCode::OK, &json!({"world_size": 1}));
        }
        _ => {}
    }
    let query = req.uri().query().map(str::to_owned);
    let body = match http_body_util::Limited::new(req.into_body(), 1 << 20)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => return vllm_error(StatusCode::BAD_REQUEST, format!("reading the body: {e}")),
    };
    let op = match parse_op(route, query.as_deref(), &body) {
        Ok(op) => op,
        Err(m) => return vllm_error(StatusCode::BAD_REQUEST, m),
    };
    let (tx, rx) = oneshot::channel();
    if state.engine.send(Msg::Control { op, reply: tx }).is_err() {
        return vllm_error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped");
    }
    match rx.await {
        Ok(Ok(v)) => super::http::json_reply(StatusCode::OK, &v),
        Ok(Err((status, m))) => vllm_error(status, m),
        Err(_) => vllm_error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"),
    }
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn pause_queries_follow_vllm() {
        assert_eq!(pause_mode(None), Ok(PauseMode::Abort));
        assert_eq!(pause_mode(Some("mode=keep")), Ok(PauseMode::Keep));
        assert_eq!(
            pause_mode(Some("wait_for_inflight_requests=true&clear_cache=false")),
            Ok(PauseMode::Wait)
        );
        let e = pause_mode(Some("mode=later")).unwrap_err();
        assert!(e.contains("`mode`") && e.contains("later"), "{e}");
        let e = pause_mode(Some("clear_cache=maybe")).unwrap_err();
        assert!(e.contains("clear_cache"), "{e}");
    }

    #[test]
    fn compare_holds_every_report_to_every_other() {
        let a: Map<String, Value> = serde_json::from_value(
            json!({"dp0:pp0:pcp0:tp0:ep0:w": "a", "dp0:pp0:pcp0:tp0:ep0:v": "b"}),
        )
        .unwrap();
        let mut b = a.clone();
        assert_eq!(
            compare(&[a.clone(), b.clone()]),
            (true, vec![], vec!["dp0:pp0:pcp0:tp0:ep0:".to_owned()])
        );
        b.insert("dp0:pp0:pcp0:tp0:ep0:w".into(), json!("x"));
        b.remove("dp0:pp0:pcp0:tp0:ep0:v");
        let (ok, mism, _) = compare(&[a, b]);
        assert!(!ok);
        assert_eq!(
            mism,
            vec!["dp0:pp0:pcp0:tp0:ep0:v", "dp0:pp0:pcp0:tp0:ep0:w"]
        );
    }
}
