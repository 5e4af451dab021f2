//! `harness serve MODEL_DIR`: an OpenAI-compatible server over our own engine (issue 23).
//!
//! `/v1/models`, `/v1/completions` and `/v1/chat/completions` (the chat template applied as
//! training applies it), streaming as server-sent events; `n`, `temperature`, `top_p`,
//! `top_k`, `max_tokens`, `stop`, `stop_token_ids`, `seed` and `logprobs` (the sampled token's),
//! and vLLM's `return_token_ids` / `return_tokens_as_token_ids`, so agent code can train on
//! exactly what was sampled. Requests share one continuous-batching [`Engine`] on a thread of its
//! own ([`worker`]); past `max_queue` samples in flight a request is refused with 429.
//!
//! [`Engine`]: rl_workers::engine::Engine

mod http;
mod openai;
mod rlhf;
mod worker;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize};

use anyhow::{Context, Result, bail};
use clap::Args;
use rl_data::Tokenizer;
use rl_workers::CausalLm;
use tokio::sync::oneshot;

use openai::ModelInfo;

/// How to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The address to listen on (port 0: a free one).
    pub addr: SocketAddr,
    /// Allow a non-loopback address (the server has no authentication).
    pub allow_remote: bool,
    /// Samples decoded at once (the engine's batch).
    pub max_batch: usize,
    /// Samples in flight (decoding or waiting) past which requests get 429.
    pub max_queue: usize,
    /// The name clients send as `model` (default: the folder's name).
    pub model_name: Option<String>,
    /// `cpu`, `cuda`, `cuda:N`.
    pub device: String,
    /// `float32` or `bfloat16`.
    pub dtype: String,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
            allow_remote: false,
            max_batch: 64,
            max_queue: 1024,
            model_name: None,
            device: "cpu".into(),
            dtype: "float32".into(),
        }
    }
}

/// What the handlers share.
pub(crate) struct State {
    pub tokenizer: Tokenizer,
    pub model: ModelInfo,
    pub engine: std::sync::mpsc::Sender<worker::Msg>,
    pub in_flight: AtomicUsize,
    pub max_queue: usize,
    pub next_key: AtomicU64,
    pub created: u64,
}

/// A running server; dropping it stops it.
pub struct ServerHandle {
    addr: SocketAddr,
    model: String,
    shutdown: Option<oneshot::Sender<()>>,
    http: Option<std::thread::JoinHandle<()>>,
    engine: Option<std::thread::JoinHandle<()>>,
    /// Weak: the state holds the engine's channel, which must close for the engine to end.
    state: std::sync::Weak<State>,
}

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle")
            .field("addr", &self.addr)
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl ServerHandle {
    /// The address it listens on (the real port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The OpenAI base URL, `http://HOST:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The name clients send as `model`.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Samples admitted and not finished (running or queued); 0 once the server has stopped.
    pub fn in_flight(&self) -> usize {
        self.state
            .upgrade()
            .map_or(0, |s| s.in_flight.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        if let Some(t) = self.http.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.http.take() {
            let _ = t.join();
        }
        // the HTTP side held the engine's channel: the engine thread ends once it is dropped
        if let Some(t) = self.engine.take() {
            let _ = t.join();
        }
    }
}

/// Loads the model and tokenizer of `dir`, binds `opts.addr` and serves on background threads;
/// every setup error (no model, a bad option, the address in use) comes back here, before
/// anything is served.
pub fn start(dir: &Path, opts: &ServeOptions) -> Result<ServerHandle> {
    if !opts.addr.ip().is_loopback() && !opts.allow_remote {
        bail!(
            "--host {}: not a loopback address; the server has no authentication, so allow remote clients explicitly (--allow-remote)",
            opts.addr.ip()
        );
    }
    if opts.max_batch == 0 {
        bail!("--max-batch: must be at least 1");
    }
    if opts.max_queue < opts.max_batch {
        bail!(
            "--max-queue {}: must be at least --max-batch ({})",
            opts.max_queue,
            opts.max_batch
        );
    }
    let device = crate::device::open(&opts.device)?;
    let kind = match opts.dtype.as_str() {
        "float32" | "fp32" => tch::Kind::Float,
        "bfloat16" | "bf16" => tch::Kind::BFloat16,
        other => bail!("--dtype {other:?}: expected float32 or bfloat16"),
    };
    let lm = CausalLm::from_pretrained(dir, device, kind)
        .with_context(|| format!("loading the model in {}", dir.display()))?;
    let tokenizer = Tokenizer::from_dir(dir)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let cfg = lm.config().clone();
    let name = match &opts.model_name {
        Some(n) => n.clone(),
        None => model_name(dir),
    };
    let model = ModelInfo {
        name: name.clone(),
        path: dir.display().to_string(),
        vocab: cfg.vocab_size,
        max_len: cfg.max_position_embeddings,
        eos: cfg
            .eos_token_id
            .as_ref()
            .map(|e| e.to_vec())
            .unwrap_or_default(),
    };
    let listener = std::net::TcpListener::bind(opts.addr)
        .with_context(|| format!("listening on {}", opts.addr))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let (engine_tx, engine) =
        worker::spawn(lm, opts.max_batch).context("starting the engine thread")?;
    let state = Arc::new(State {
        tokenizer,
        model,
        engine: engine_tx,
        in_flight: AtomicUsize::new(0),
        max_queue: opts.max_queue,
        next_key: AtomicU64::new(0),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    let served = Arc::downgrade(&state);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let (tx, rx) = oneshot::channel();
    let http = std::thread::Builder::new()
        .name(format!("serve-{}", addr.port()))
        .spawn(move || {
            rt.block_on(rl_tools::http::accept_std(
                listener,
                "serve",
                rx,
                move |req| http::handle(req, state.clone()),
            ));
        })
        .context("starting the HTTP thread")?;
    Ok(ServerHandle {
        addr,
        model: name,
        shutdown: Some(tx),
        http: Some(http),
        state: served,
        engine: Some(engine),
    })
}

/// `harness serve MODEL_DIR`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A Hugging Face folder (a checkpoint's export, `runs/<id>-<name>/model`, or an import).
    pub model_dir: PathBuf,
    /// The port; 0 picks a free one (printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Allow a non-loopback `--host` (the server has no authentication).
    #[arg(long)]
    pub allow_remote: bool,
    /// Samples decoded at once (continuous batching: new requests join between steps).
    #[arg(long, default_value_t = 64)]
    pub max_batch: usize,
    /// Samples in flight (decoding or waiting) past which a request is refused with 429.
    #[arg(long, default_value_t = 1024)]
    pub max_queue: usize,
    /// The name clients send as `model` (default: the folder's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// `float32` or `bfloat16`.
    #[arg(long, default_value = "float32")]
    pub dtype: String,
}

/// Runs `harness serve` until the process is stopped.
pub fn run(args: &ServeArgs) -> Result<()> {
    let opts = ServeOptions {
        addr: SocketAddr::new(args.host, args.port),
        allow_remote: args.allow_remote,
        max_batch: args.max_batch,
        max_queue: args.max_queue,
        model_name: args.served_model_name.clone(),
        device: args.device.clone(),
        dtype: args.dtype.clone(),
    };
    let server = start(&args.model_dir, &opts)?;
    crate::outln!(
        "serving {} as {:?} at {} (OpenAI API: /models, /completions, /chat/completions)",
        args.model_dir.display(),
        server.model(),
        server.base_url()
    );
    std::io::Write::flush(&mut std::io::stdout()).context("writing to stdout")?;
    server.wait();
    Ok(())
}

/// The served name: the folder's last component.
fn model_name(dir: &Path) -> String {
    let dir: PathBuf = dir.components().collect();
    dir.file_name()
        .map_or_else(|| "model".to_owned(), |n| n.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests;
