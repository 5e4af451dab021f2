//! The accept loop of the HTTP/1.1 servers of the workspace (the retriever here, `harness
//! serve` in rl-harness): every connection on a task of its own, served by `handle`, until
//! `shutdown` fires.

use std::convert::Infallible;
use std::future::Future;

use hyper::body::{Body, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

/// Serves `listener` (non-blocking, bound) with `handle` until `shutdown` fires or is dropped;
/// `name` prefixes what it logs.
pub async fn accept_loop<F, Fut, B>(
    listener: std::net::TcpListener,
    name: &'static str,
    mut shutdown: oneshot::Receiver<()>,
    handle: F,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("{name}: cannot listen: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!("{name}: accept failed: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let handle = handle.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(handle);
                    if let Err(e) = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await
                    {
                        tracing::debug!("{name}: connection ended: {e}");
                    }
                });
            }
        }
    }
}
