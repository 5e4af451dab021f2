//! The HTTP side of `harness serve`: routes, the OpenAI response bodies, server-sent events.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use rl_workers::engine::{Emitted, Finish};
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::sync::oneshot;

use super::State;
use super::openai::{Endpoint, Generation, parse};
use super::worker::{Event, Msg};

pub(crate) type Reply = Response<BoxBody<Bytes, Infallible>>;

/// The largest request body accepted (bytes).
const MAX_BODY: usize = 16 << 20;

pub(crate) fn json_reply(status: StatusCode, body: &Value) -> Reply {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// OpenAI's error body.
fn error(status: StatusCode, message: impl Into<String>) -> Reply {
    let kind = match status {
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::NOT_FOUND => "not_found_error",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    };
    json_reply(
        status,
        &json!({"error": {"message": message.into(), "type": kind, "param": null, "code": null}}),
    )
}

pub(crate) async fn handle(req: Request<Incoming>, state: Arc<State>) -> Result<Reply, Infallible> {
    if let Some(route) = super::rlhf::route(req.method(), req.uri().path()) {
        return Ok(super::rlhf::handle(route, req, state).await);
    }
    let endpoint = match (req.method(), req.uri().path()) {
        (&Method::GET, "/v1/models") => return Ok(models(&state)),
        (&Method::GET, "/health") => return Ok(json_reply(StatusCode::OK, &json!({}))),
        (&Method::GET, "/get_model_info") => {
            return Ok(json_reply(
                StatusCode::OK,
                &json!({"model_path": state.model.path, "is_generation": true}),
            ));
        }
        (&Method::GET, "/weights_checksum") => return Ok(checksum(&state).await),
        (&Method::POST, "/update_weights_from_disk") => {
            let body = match read_body(req).await {
                Ok(b) => b,
                Err(r) => return Ok(r),
            };
            return Ok(update_weights(&state, &body).await);
        }
        (&Method::POST, "/v1/completions") => Endpoint::Completions,
        (&Method::POST, "/v1/chat/completions") => Endpoint::Chat,
        (m, p) => {
            return Ok(error(
                StatusCode::NOT_FOUND,
                format!(
                    "no route {m} {p} (this server has GET /v1/models, POST /v1/completions, POST /v1/chat/completions, SGLang's POST /update_weights_from_disk and vLLM's RL control plane: docs/serving.md)"
                ),
            ));
        }
    };
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(r) => return Ok(r),
    };
    let g = match parse(&body, endpoint, &state.model, &state.tokenizer) {
        Ok(g) => g,
        Err(message) => return Ok(error(StatusCode::BAD_REQUEST, message)),
    };
    Ok(generate(state, endpoint, g).await)
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, Reply> {
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(error(
            StatusCode::BAD_REQUEST,
            format!("reading the body (at most {MAX_BODY} bytes): {e}"),
        )),
    }
}

/// SGLang's `POST /update_weights_from_disk` (`{"model_path": DIR}`): the engine loads the
/// folder's weights once its running batch has drained; the answer carries the new weights'
/// checksum (ours, as `GET /weights_checksum` gives it) for the trainer to compare.
async fn update_weights(state: &State, body: &[u8]) -> Reply {
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("the body is not JSON: {e}"),
            );
        }
    };
    let Some(dir) = v.get("model_path").and_then(Value::as_str) else {
        return error(
            StatusCode::BAD_REQUEST,
            "missing `model_path` (the Hugging Face folder to load)",
        );
    };
    if let Some(f) = v
        .get("load_format")
        .filter(|f| !f.is_null() && f.as_str() != Some("auto"))
    {
        return error(
            StatusCode::BAD_REQUEST,
            format!("`load_format` {f} is not supported (safetensors folders only)"),
        );
    }
    let (tx, rx) = oneshot::channel();
    let msg = Msg::UpdateWeights {
        dir: dir.into(),
        reply: tx,
    };
    if state.engine.send(msg).is_err() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped");
    }
    match rx.await {
        Ok(Ok(sha)) => json_reply(
            StatusCode::OK,
            &json!({"success": true, "message": format!("loaded the weights of {dir}"), "weights_sha256": sha}),
        ),
        Ok(Err(message)) => json_reply(
            StatusCode::BAD_REQUEST,
            &json!({"success": false, "message": message}),
        ),
        Err(_) => error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"),
    }
}

async fn checksum(state: &State) -> Reply {
    let (tx, rx) = oneshot::channel();
    if state.engine.send(Msg::Checksum(tx)).is_err() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped");
    }
    match rx.await {
        Ok(sha) => json_reply(StatusCode::OK, &json!({"sha256": sha})),
        Err(_) => error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"),
    }
}

fn models(state: &State) -> Reply {
    json_reply(
        StatusCode::OK,
        &json!({"object": "list", "data": [{
            "id": state.model.name,
            "object": "model",
            "created": state.created,
            "owned_by": "harness",
            "max_model_len": state.model.max_len,
        }]}),
    )
}

/// Samples counted in flight until dropped.
struct InFlight {
    state: Arc<State>,
    jobs: usize,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(self.jobs, Ordering::SeqCst);
    }
}

/// One choice being generated.
struct Choice {
    prompt: usize,
    key: u64,
    ids: Vec<i64>,
    log_probs: Vec<f32>,
    text: String,
    /// Bytes of `text` already streamed.
    sent: usize,
    /// Decode after every token (streaming, or stop strings to watch for).
    eager: bool,
    finish: Option<&'static str>,
}

impl Choice {
    /// Ends the choice where it is (vLLM's pause in abort mode): `finish_reason: "abort"` with
    /// the tokens it had. The text not yet streamed.
    fn abort(&mut self, state: &State) -> String {
        if self.finish.is_some() {
            return String::new();
        }
        let ids: Vec<u32> = self.ids.iter().map(|&t| t as u32).collect();
        self.text = state.tokenizer.decode(&ids, true).unwrap_or_default();
        self.finish = Some("abort");
        let delta = self.text.get(self.sent..).unwrap_or_default().to_owned();
        self.sent = self.text.len();
        delta
    }

    /// Takes a token unless the choice has ended already (its job may still emit one or two
    /// after a stop string ended it); cancels the job when a stop string ends it here. The
    /// streamable text it adds.
    fn take(&mut self, e: &Emitted, state: &State, stop: &[String]) -> Option<String> {
        if self.finish.is_some() {
            return None;
        }
        let (delta, by_stop) = self.push(e, state, stop);
        if by_stop {
            let _ = state.engine.send(Msg::Cancel(self.key));
        }
        Some(delta)
    }

    /// Takes one token: the text so far (cut before a stop string), and the streamable part
    /// not yet sent. Returns true when the choice ended here by a stop string.
    fn push(&mut self, e: &Emitted, state: &State, stop: &[String]) -> (String, bool) {
        self.ids.push(e.token);
        self.log_probs.push(e.log_prob);
        // nothing reads the text before the end unless it streams or watches for stop strings:
        // decoding every prefix would make a long answer quadratic for nothing
        if !self.eager && e.finish.is_none() {
            return (String::new(), false);
        }
        let ids: Vec<u32> = self.ids.iter().map(|&t| t as u32).collect();
        let full = state.tokenizer.decode(&ids, true).unwrap_or_default();
        let cut = stop.iter().filter_map(|s| full.find(s.as_str())).min();
        let mut by_stop = false;
        if let Some(at) = cut {
            self.text = full[..at].to_owned();
            self.finish = Some("stop");
            by_stop = e.finish.is_none();
        } else {
            self.text = full;
            self.finish = e.finish.map(|f| match f {
                Finish::Stop => "stop",
                Finish::Length => "length",
            });
        }
        // while running, hold back an incomplete character and what may start a stop string
        let mut visible = self.text.len();
        if self.finish.is_none() {
            visible = self.text.trim_end_matches('\u{FFFD}').len();
            for s in stop {
                for k in (1..s.len()).rev() {
                    if s.is_char_boundary(k) && self.text[..visible].ends_with(&s[..k]) {
                        visible -= k;
                        break;
                    }
                }
            }
        }
        let delta = self
            .text
            .get(self.sent..visible)
            .unwrap_or_default()
            .to_owned();
        self.sent = self.sent.max(visible);
        (delta, by_stop)
    }
}

fn token_text(state: &State, g: &Generation, id: i64) -> String {
    if g.tokens_as_ids {
        format!("token_id:{id}")
    } else {
        state
            .tokenizer
            .decode(&[id as u32], false)
            .unwrap_or_default()
    }
}

/// The log-probs object of `tokens` (completions' or chat's shape).
fn logprobs_json(
    state: &State,
    g: &Generation,
    endpoint: Endpoint,
    ids: &[i64],
    lps: &[f32],
) -> Value {
    let texts: Vec<String> = ids.iter().map(|&t| token_text(state, g, t)).collect();
    match endpoint {
        Endpoint::Completions => {
            let mut offset = 0;
            let offsets: Vec<usize> = texts
                .iter()
                .map(|t| {
                    let o = offset;
                    offset += t.len();
                    o
                })
                .collect();
            json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": null, "text_offset": offsets})
        }
        Endpoint::Chat => json!({"content": texts.iter().zip(lps).map(|(t, lp)| json!({
            "token": t, "logprob": lp, "bytes": t.as_bytes(), "top_logprobs": [],
        })).collect::<Vec<_>>()}),
    }
}

fn object_names(endpoint: Endpoint) -> (&'static str, &'static str, &'static str) {
    match endpoint {
        Endpoint::Completions => ("cmpl", "text_completion", "text_completion"),
        Endpoint::Chat => ("chatcmpl", "chat.completion", "chat.completion.chunk"),
    }
}

async fn generate(state: Arc<State>, endpoint: Endpoint, g: Generation) -> Reply {
    let jobs = g.prompts.len() * g.n;
    let before = state.in_flight.fetch_add(jobs, Ordering::SeqCst);
    let guard = InFlight {
        state: state.clone(),
        jobs,
    };
    if before + jobs > state.max_queue {
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "the server is full: {before} samples in flight, this request adds {jobs}, the limit is {} (--max-queue); retry later",
                state.max_queue
            ),
        );
    }
    let (tx, rx) = unbounded_channel();
    let mut choices = Vec::with_capacity(jobs);
    for (p, prompt) in g.prompts.iter().enumerate() {
        for j in 0..g.n {
            let key = state.next_key.fetch_add(1, Ordering::SeqCst);
            let mut params = g.params.clone();
            params.stream = g.stream_offset + j as u64;
            let submitted = state.engine.send(Msg::Submit {
                key,
                tag: choices.len(),
                prompt: prompt.clone(),
                params,
                events: tx.clone(),
            });
            if submitted.is_err() {
                return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped");
            }
            choices.push(Choice {
                prompt: p,
                key,
                ids: Vec::new(),
                log_probs: Vec::new(),
                text: String::new(),
                sent: 0,
                eager: g.stream || !g.stop.is_empty(),
                finish: None,
            });
        }
    }
    drop(tx);
    let id = format!(
        "{}-{}",
        object_names(endpoint).0,
        state.next_key.fetch_add(1, Ordering::SeqCst)
    );
    if g.stream {
        let (body_tx, body_rx) = unbounded_channel();
        tokio::spawn(stream(state, endpoint, g, choices, rx, body_tx, id, guard));
        let mut r = Response::new(SseBody { rx: body_rx }.boxed());
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("text/event-stream"),
        );
        return r;
    }
    collect(state, endpoint, g, choices, rx, id).await
}

/// Runs every choice to its end, then answers in one body.
async fn collect(
    state: Arc<State>,
    endpoint: Endpoint,
    g: Generation,
    mut choices: Vec<Choice>,
    mut rx: UnboundedReceiver<(usize, Event)>,
    id: String,
) -> Reply {
    while choices.iter().any(|c| c.finish.is_none()) {
        let Some((tag, ev)) = rx.recv().await else {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine stopped mid-request",
            );
        };
        match ev {
            Event::Failed(m) => return error(StatusCode::INTERNAL_SERVER_ERROR, m),
            Event::Token(e) => {
                choices[tag].take(&e, &state, &g.stop);
            }
            Event::Aborted => {
                choices[tag].abort(&state);
            }
        }
    }
    let (_, object, _) = object_names(endpoint);
    let completion_tokens: usize = choices.iter().map(|c| c.ids.len()).sum();
    let prompt_tokens: usize = g.prompts.iter().map(Vec::len).sum();
    let out: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = g
                .logprobs
                .then(|| logprobs_json(&state, &g, endpoint, &c.ids, &c.log_probs));
            let mut choice = match endpoint {
                Endpoint::Completions => json!({
                    "index": i, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish,
                }),
                Endpoint::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish,
                }),
            };
            if g.return_token_ids {
                choice["token_ids"] = json!(c.ids);
                choice["prompt_token_ids"] = json!(g.prompts[c.prompt]);
            }
            choice
        })
        .collect();
    json_reply(
        StatusCode::OK,
        &json!({
            "id": id,
            "object": object,
            "created": now(),
            "model": state.model.name,
            "choices": out,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }),
    )
}

/// Streams one chunk per token (and a closing one per choice), then `data: [DONE]`.
#[allow(clippy::too_many_arguments)]
async fn stream(
    state: Arc<State>,
    endpoint: Endpoint,
    g: Generation,
    mut choices: Vec<Choice>,
    mut rx: UnboundedReceiver<(usize, Event)>,
    body: UnboundedSender<Bytes>,
    id: String,
    _guard: InFlight,
) {
    let (_, _, object) = object_names(endpoint);
    let created = now();
    let send = |choice: Value| {
        let chunk = json!({
            "id": id, "object": object, "created": created, "model": state.model.name,
            "choices": [choice],
        });
        body.send(Bytes::from(format!("data: {chunk}\n\n"))).is_ok()
    };
    if endpoint == Endpoint::Chat {
        for i in 0..choices.len() {
            let first = json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            if !send(first) {
                return;
            }
        }
    }
    while choices.iter().any(|c| c.finish.is_none()) {
        let Some((tag, ev)) = rx.recv().await else {
            return;
        };
        let e = match ev {
            Event::Failed(m) => {
                let err = json!({"error": {"message": m, "type": "server_error"}});
                let _ = body.send(Bytes::from(format!("data: {err}\n\n")));
                return;
            }
            Event::Token(e) => e,
            Event::Aborted => {
                let c = &mut choices[tag];
                if c.finish.is_some() {
                    continue;
                }
                let delta = c.abort(&state);
                let choice = match endpoint {
                    Endpoint::Completions => {
                        json!({"index": tag, "text": delta, "logprobs": null, "finish_reason": "abort"})
                    }
                    Endpoint::Chat => {
                        json!({"index": tag, "delta": {"content": delta}, "logprobs": null, "finish_reason": "abort"})
                    }
                };
                if !send(choice) {
                    return;
                }
                continue;
            }
        };
        let c = &mut choices[tag];
        let Some(delta) = c.take(&e, &state, &g.stop) else {
            continue;
        };
        let logprobs = g
            .logprobs
            .then(|| logprobs_json(&state, &g, endpoint, &[e.token], &[e.log_prob]));
        let mut choice = match endpoint {
            Endpoint::Completions => {
                json!({"index": tag, "text": delta, "logprobs": logprobs, "finish_reason": c.finish})
            }
            Endpoint::Chat => {
                let delta = if c.finish.is_some() && delta.is_empty() {
                    json!({})
                } else {
                    json!({"content": delta})
                };
                json!({"index": tag, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish})
            }
        };
        if g.return_token_ids {
            choice["token_ids"] = json!([e.token]);
        }
        if !send(choice) {
            return;
        }
    }
    let _ = body.send(Bytes::from_static(b"data: [DONE]\n\n"));
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A body fed from a channel: each message one frame; it ends when the sender is dropped.
struct SseBody {
    rx: UnboundedReceiver<Bytes>,
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}
