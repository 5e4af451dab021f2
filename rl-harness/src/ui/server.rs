//! The HTTP side of the run browser (hyper, HTTP/1.1): the accept loop, the routes, and turning
//! a view's answer or [`Fault`] into a response. Only `GET` is served; nothing is written.

use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

use super::api::{self, Fault};
use super::assets;
use crate::analysis::compare::Mode;
use crate::store::Store;

type Reply = Response<Full<Bytes>>;

/// Accepts connections on `listener` and serves each on its own task, until the future is
/// dropped.
pub(super) async fn accept_loop(listener: tokio::net::TcpListener, store: Arc<Store>) {
    rl_tools::http::accept_loop(listener, "ui", std::future::pending(), move |req| {
        let store = store.clone();
        async move { Ok::<_, std::convert::Infallible>(handle(req, &store).await) }
    })
    .await;
}

fn reply(status: StatusCode, content_type: &'static str, body: Bytes) -> Reply {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    // the store changes under the page: every answer is read fresh
    r.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn json_reply(status: StatusCode, v: &Value) -> Reply {
    reply(status, "application/json", Bytes::from(v.to_string()))
}

fn error(status: StatusCode, message: String) -> Reply {
    json_reply(status, &json!({ "error": message }))
}

/// The query string's pairs, percent-decoded.
fn query_pairs(req: &Request<Incoming>) -> Vec<(String, String)> {
    form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

/// Every value of parameter `name`.
fn all<'a>(q: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    q.iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

/// The last value of parameter `name`.
fn one<'a>(q: &'a [(String, String)], name: &str) -> Option<&'a str> {
    all(q, name).pop()
}

/// The run ids of the `run` parameters (each may also be a comma-separated list).
fn run_ids(q: &[(String, String)]) -> Result<Vec<i64>, Fault> {
    all(q, "run")
        .into_iter()
        .flat_map(|v| v.split(','))
        .filter(|v| !v.trim().is_empty())
        .map(api::run_id)
        .collect()
}

fn mode(q: &[(String, String)]) -> Result<Mode, Fault> {
    match one(q, "mode").unwrap_or("auto") {
        "auto" => Ok(Mode::Auto),
        "max" => Ok(Mode::Max),
        "min" => Ok(Mode::Min),
        other => Err(Fault::BadRequest(format!(
            "mode `{other}` is not one of auto, max, min"
        ))),
    }
}

async fn handle(req: Request<Incoming>, store: &Store) -> Reply {
    if req.method() != Method::GET {
        return error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!(
                "{} {}: the run browser only reads (GET)",
                req.method(),
                req.uri().path()
            ),
        );
    }
    let path = req.uri().path().to_string();
    if let Some(asset) = assets::find(&path) {
        return reply(
            StatusCode::OK,
            asset.content_type,
            Bytes::from_static(asset.body),
        );
    }
    let Some(view) = path.strip_prefix("/api/") else {
        return error(
            StatusCode::NOT_FOUND,
            format!("no page {path} (the run browser starts at /)"),
        );
    };
    let q = query_pairs(&req);
    let answer = match view.split_once('/').unwrap_or((view, "")) {
        ("runs", "") => api::runs(store, one(&q, "filter")).await,
        ("keys", "") => match run_ids(&q) {
            Ok(ids) => api::keys(store, &ids).await,
            Err(f) => Err(f),
        },
        ("series", "") => match run_ids(&q) {
            Ok(ids) => {
                let keys: Vec<String> = all(&q, "key").into_iter().map(String::from).collect();
                api::series(store, &ids, &keys).await
            }
            Err(f) => Err(f),
        },
        ("run", id) if !id.is_empty() => match api::run_id(id) {
            Ok(id) => api::run(store, id).await,
            Err(f) => Err(f),
        },
        ("diff", "") => match run_ids(&q) {
            Ok(ids) => api::diff(store, &ids).await,
            Err(f) => Err(f),
        },
        ("sweeps", "") => api::sweeps(store).await,
        ("sweep", id) if !id.is_empty() => match mode(&q) {
            Ok(m) => api::sweep_view(store, id, one(&q, "metric"), m).await,
            Err(f) => Err(f),
        },
        _ => Err(Fault::NotFound(format!(
            "no view {path} (the views: /api/runs, /api/keys, /api/series, /api/run/ID, \
             /api/diff, /api/sweeps, /api/sweep/ID)"
        ))),
    };
    match answer {
        Ok(v) => json_reply(StatusCode::OK, &v),
        Err(Fault::BadRequest(m)) => error(StatusCode::BAD_REQUEST, m),
        Err(Fault::NotFound(m)) => error(StatusCode::NOT_FOUND, m),
        Err(Fault::Store(e)) => {
            let m = crate::console::one_line(&e);
            tracing::warn!("ui: {path}: {m}");
            error(StatusCode::INTERNAL_SERVER_ERROR, m)
        }
    }
}
