//! The accept loop of the HTTP/1.1 servers of the workspace (the retriever here, `harness
//! serve` and `harness ui` in rl-harness): every connection on a task of its own, served by
//! `handle`, until `shutdown` completes (or the future is dropped).

use std::convert::Infallible;
use std::future::Future;

use hyper::body::{Body, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

/// [`accept_loop`] on a bound, non-blocking std listener (made a tokio one here, inside the
/// runtime), until `shutdown` fires or its sender is dropped.
pub async fn accept_std<F, Fut, B>(
    listener: std::net::TcpListener,
    name: &'static str,
    shutdown: oneshot::Receiver<()>,
    handle: F,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => {
            accept_loop(
                l,
                name,
                async {
                    let _ = shutdown.await;
                },
                handle,
            )
            .await;
        }
        Err(e) => tracing::error!("{name}: cannot listen: {e}"),
    }
}

/// Serves `listener` with `handle` until `shutdown` completes; `name` prefixes what it logs.
pub async fn accept_loop<F, Fut, B>(
    listener: tokio::net::TcpListener,
    name: &'static str,
    shutdown: impl Future<Output = ()>,
    handle: F,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
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
