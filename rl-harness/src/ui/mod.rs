//! `harness ui`: the run browser, a local web page served by the binary itself. It reads the
//! SQLite store directly and only reads it (opened read-only, never migrated, so it works while
//! runs write through WAL), and its page is embedded in the binary ([`assets`]): the runs table
//! with the `runs --filter` language, metric charts overlaying runs (uPlot, vendored), a run's
//! page (config, events, checkpoints, generations, the resume command), config diffs and sweep
//! rankings with a parallel-coordinates view.
//!
//! Parts: [`api`] (the JSON views over the store and `analysis`), `server` (routes and the
//! accept loop), `assets` (the embedded files). It uses `store`, `config` and `analysis`;
//! only `cli` uses it.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};

use crate::store::Store;

pub mod api;
mod assets;
mod server;

/// Where `harness ui` serves which store.
#[derive(Debug, Clone)]
pub struct Options {
    /// The run store.
    pub db: PathBuf,
    /// The address to listen on (127.0.0.1 unless told otherwise).
    pub host: IpAddr,
    /// The port (0: any free one; the printed address says which).
    pub port: u16,
}

/// A run browser serving in the background of a runtime (benchmarks, tests); it stops when
/// dropped.
#[derive(Debug)]
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Opens the store `db` strictly read-only: an error naming the path when there is none.
async fn open(db: &Path) -> Result<Store> {
    if !db.is_file() {
        bail!(
            "no run store at {} (`harness train` makes one; --db PATH names another)",
            db.display()
        );
    }
    Store::open_strictly_read_only(db)
        .await
        .with_context(|| format!("opening the run store {} to browse", db.display()))
}

/// Starts serving `opts.db` on the current runtime; returns once it listens.
pub async fn start(opts: &Options) -> Result<Running> {
    let store = Arc::new(open(&opts.db).await?);
    let addr = SocketAddr::new(opts.host, opts.port);
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        let why = if e.kind() == std::io::ErrorKind::AddrInUse {
            " (another program has that port; pick another with --port, or --port 0 for any \
             free one)"
        } else {
            ""
        };
        anyhow::anyhow!("cannot listen on {addr}: {e}{why}")
    })?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let task = tokio::spawn(server::accept_loop(listener, store));
    Ok(Running { addr, task })
}

/// `harness ui`: serves until Ctrl-C (or SIGTERM).
pub async fn serve(opts: Options) -> Result<()> {
    let running = start(&opts).await?;
    if !opts.host.is_loopback() {
        note!(
            "harness ui: listening on {} with no authentication: anyone who reaches it can read \
             every run",
            opts.host
        );
    }
    outln!(
        "harness ui: http://{}/ browsing {} (read-only); Ctrl-C stops it",
        running.addr,
        opts.db.display()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("listening for Ctrl-C")?,
        _ = term.recv() => {}
    }
    drop(running);
    Ok(())
}
