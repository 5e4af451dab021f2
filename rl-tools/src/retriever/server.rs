//! The retrieval server: Search-R1's `POST /retrieve` protocol over HTTP/1.1 (hyper), on a
//! background thread with its own tokio runtime.
//!
//! Request: `{"queries": ["..."], "topk": 3, "return_scores": true}` (`topk` and
//! `return_scores` optional). Response: `{"result": [[{"document": {"id", "contents"}, "score":
//! s}, ...], ...]}` with scores, `{"result": [[{"id", "contents"}, ...], ...]}` without, one
//! list per query in query order. A malformed request gets HTTP 400 and `{"error": "..."}`
//! naming the field.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::{MAX_TOPK, Retriever};
use crate::error::{Error, Result};

/// The largest request body accepted (bytes).
const MAX_BODY: usize = 16 << 20;

/// Where and how to serve an index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeOptions {
    /// The address to listen on; port 0 picks a free port. Default `127.0.0.1:8000`
    /// (Search-R1's retriever port).
    pub addr: SocketAddr,
    /// Allow a non-loopback address (the server has no authentication). Default false.
    pub allow_remote: bool,
    /// Passages per query when a request has no `topk` (Search-R1's `retrieval_topk`).
    /// Default 3.
    pub default_topk: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 8000)),
            allow_remote: false,
            default_topk: 3,
        }
    }
}

/// A running server; dropping it stops the server and waits for its thread.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    docs: u64,
    state: Arc<State>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ServerHandle {
    /// The address it listens on (with the real port when port 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The retrieval endpoint, `http://ADDR/retrieve`, what [`crate::ToolSpec`]'s `url` takes.
    pub fn url(&self) -> String {
        format!("http://{}/retrieve", self.addr)
    }

    /// Passages in the served index.
    pub fn num_docs(&self) -> u64 {
        self.docs
    }

    /// `/retrieve` requests answered so far (any status).
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::Relaxed)
    }

    /// Blocks until the server stops (it only stops when the handle is dropped or the process
    /// ends, so this serves forever).
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves the index in `dir` on `127.0.0.1:port` (0 = a free port) on a background thread.
pub fn serve_in_background(dir: &Path, port: u16) -> Result<ServerHandle> {
    start_server(
        dir,
        &ServeOptions {
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            ..ServeOptions::default()
        },
    )
}

/// Serves the index in `dir` and blocks for good (the CLI's `harness retriever serve`).
pub fn serve(dir: &Path, opts: &ServeOptions) -> Result<()> {
    start_server(dir, opts)?.wait();
    Ok(())
}

/// Opens the index in `dir`, binds `opts.addr` and serves on a background thread; errors
/// (no index, address in use, a non-loopback address without `allow_remote`) come back here,
/// before anything is served.
pub fn start_server(dir: &Path, opts: &ServeOptions) -> Result<ServerHandle> {
    let addr = opts.addr;
    let fail = |message: String| Error::Serve { addr, message };
    if !addr.ip().is_loopback() && !opts.allow_remote {
        return Err(fail(
            "not a loopback address; the server has no authentication, so allow remote \
             clients explicitly (`--allow-remote`)"
                .into(),
        ));
    }
    if !(1..=MAX_TOPK).contains(&opts.default_topk) {
        return Err(Error::Config {
            key: "default_topk".into(),
            message: format!("must be in 1..={MAX_TOPK}, got {}", opts.default_topk),
        });
    }
    let retriever = Retriever::open(dir)?;
    let docs = retriever.num_docs();
    let listener = std::net::TcpListener::bind(addr).map_err(|e| fail(e.to_string()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(e.to_string()))?;
    let bound = listener.local_addr().map_err(|e| fail(e.to_string()))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| fail(format!("starting the runtime: {e}")))?;
    let (tx, rx) = oneshot::channel();
    let state = Arc::new(State {
        retriever,
        default_topk: opts.default_topk,
        requests: AtomicU64::new(0),
    });
    let served = state.clone();
    let thread = std::thread::Builder::new()
        .name(format!("retriever-{}", bound.port()))
        .spawn(move || {
            rt.block_on(crate::http::accept_std(
                listener,
                "retriever",
                rx,
                move |req| handle(req, served.clone()),
            ));
        })
        .map_err(|e| fail(format!("starting the server thread: {e}")))?;
    Ok(ServerHandle {
        addr: bound,
        docs,
        state,
        shutdown: Some(tx),
        thread: Some(thread),
    })
}

#[derive(Debug)]
struct State {
    retriever: Retriever,
    default_topk: usize,
    requests: AtomicU64,
}

fn reply(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn error(status: StatusCode, message: impl Into<String>) -> Response<Full<Bytes>> {
    reply(status, &json!({ "error": message.into() }))
}

/// A checked `/retrieve` request.
#[derive(Debug, PartialEq)]
struct RetrieveRequest {
    queries: Vec<String>,
    topk: usize,
    return_scores: bool,
}

/// Checks a request body; the error names the field at fault.
fn parse_request(body: &[u8], default_topk: usize) -> std::result::Result<RetrieveRequest, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let Value::Object(map) = v else {
        return Err("the body must be a JSON object with `queries`".into());
    };
    if let Some(k) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "queries" | "topk" | "return_scores"))
    {
        return Err(format!(
            "unknown field `{k}` (expected `queries`, `topk`, `return_scores`)"
        ));
    }
    let queries = match map.get("queries") {
        None => return Err("missing field `queries` (a list of strings)".into()),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, q)| {
                q.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("`queries[{i}]` must be a string, got {q}"))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?,
        Some(other) => return Err(format!("`queries` must be a list of strings, got {other}")),
    };
    let topk = match map.get("topk") {
        None | Some(Value::Null) => default_topk,
        Some(v) => match v.as_u64() {
            Some(k) if (1..=MAX_TOPK as u64).contains(&k) => k as usize,
            _ => {
                return Err(format!(
                    "`topk` must be an integer in 1..={MAX_TOPK}, got {v}"
                ));
            }
        },
    };
    let return_scores = match map.get("return_scores") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(format!("`return_scores` must be true or false, got {v}")),
    };
    Ok(RetrieveRequest {
        queries,
        topk,
        return_scores,
    })
}

async fn handle(
    req: Request<Incoming>,
    state: Arc<State>,
) -> std::result::Result<Response<Full<Bytes>>, Infallible> {
    if req.uri().path() != "/retrieve" {
        return Ok(error(
            StatusCode::NOT_FOUND,
            format!("no such path `{}`; use POST /retrieve", req.uri().path()),
        ));
    }
    state.requests.fetch_add(1, Ordering::Relaxed);
    if req.method() != Method::POST {
        return Ok(error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("method {} not allowed; use POST /retrieve", req.method()),
        ));
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Ok(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("cannot read the body (at most {MAX_BODY} bytes): {e}"),
            ));
        }
    };
    let request = match parse_request(&body, state.default_topk) {
        Ok(r) => r,
        Err(message) => return Ok(error(StatusCode::BAD_REQUEST, message)),
    };
    let searched = {
        let state = state.clone();
        let queries = request.queries;
        let topk = request.topk;
        tokio::task::spawn_blocking(move || state.retriever.search(&queries, topk)).await
    };
    let results = match searched {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Ok(error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
        Err(e) => {
            return Ok(error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("search failed: {e}"),
            ));
        }
    };
    let result: Vec<Value> = results
        .into_iter()
        .map(|hits| {
            hits.into_iter()
                .map(|(doc, score)| {
                    if request.return_scores {
                        json!({ "document": doc, "score": score })
                    } else {
                        json!(doc)
                    }
                })
                .collect()
        })
        .collect();
    Ok(reply(StatusCode::OK, &json!({ "result": result })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_checked_field_by_field() {
        let ok = parse_request(
            br#"{"queries": ["a", "b"], "topk": 2, "return_scores": true}"#,
            3,
        );
        assert_eq!(
            ok,
            Ok(RetrieveRequest {
                queries: vec!["a".into(), "b".into()],
                topk: 2,
                return_scores: true
            })
        );
        let defaults = parse_request(br#"{"queries": []}"#, 3).unwrap();
        assert_eq!((defaults.topk, defaults.return_scores), (3, false));
        let cases: [(&[u8], &str); 8] = [
            (b"not json", "not JSON"),
            (b"[1]", "JSON object"),
            (br#"{"topk": 3}"#, "missing field `queries`"),
            (br#"{"queries": "a"}"#, "`queries` must be a list"),
            (br#"{"queries": ["a", 3]}"#, "`queries[1]` must be a string"),
            (
                br#"{"queries": [], "topk": 0}"#,
                "`topk` must be an integer",
            ),
            (br#"{"queries": [], "return_scores": 1}"#, "`return_scores`"),
            (br#"{"queries": [], "top_k": 1}"#, "unknown field `top_k`"),
        ];
        for (body, want) in cases {
            let e = parse_request(body, 3).unwrap_err();
            assert!(e.contains(want), "{e:?} should contain {want:?}");
        }
    }
}
