//! The engine thread of `harness serve`: it owns the model and its continuous-batching
//! [`Engine`], takes jobs (one prompt, one sample) from the HTTP handlers over a channel, and
//! sends each job's tokens back on the channel the job names, tagged with the job's key. A job
//! whose receiver is gone (the client left) or that its handler cancels (a stop string) leaves
//! the batch at the next step.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;

use rl_workers::CausalLm;
use rl_workers::engine::{Emitted, Engine, SamplingParams};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

/// What a job's handler hears.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// A token (the last one carries its finish reason).
    Token(Emitted),
    /// The engine failed; the job is over.
    Failed(String),
}

/// The handlers' messages to the engine thread.
pub(crate) enum Msg {
    /// Start a job: its key (unique per server), prompt and sampling settings, and where its
    /// events go (tagged with `tag`).
    Submit {
        key: u64,
        tag: usize,
        prompt: Vec<i64>,
        params: SamplingParams,
        events: UnboundedSender<(usize, Event)>,
    },
    /// Stop a job early.
    Cancel(u64),
    /// Load the weights of a Hugging Face folder once the running batch has drained (no
    /// sample mixes two policies; waiting requests wait), answering with the new weights'
    /// checksum ([`CausalLm::weights_sha256`]) or the error.
    UpdateWeights {
        dir: PathBuf,
        reply: oneshot::Sender<Result<String, String>>,
    },
    /// The current weights' checksum.
    Checksum(oneshot::Sender<String>),
}

struct Job {
    key: u64,
    tag: usize,
    events: UnboundedSender<(usize, Event)>,
}

/// Starts the engine thread over `lm`, decoding at most `max_rows` jobs at once; it ends when
/// every sender of the returned channel is dropped.
pub(crate) fn spawn(
    lm: CausalLm,
    max_rows: usize,
) -> std::io::Result<(mpsc::Sender<Msg>, JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("serve-engine".into())
        .spawn(move || run(&lm, max_rows, &rx))?;
    Ok((tx, thread))
}

fn run(lm: &CausalLm, max_rows: usize, rx: &mpsc::Receiver<Msg>) {
    let mut engine = match Engine::new(lm, max_rows) {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("serve: cannot start the engine: {e}");
            return;
        }
    };
    // engine request id -> job
    let mut jobs: HashMap<u64, Job> = HashMap::new();
    let mut updates: Vec<(PathBuf, oneshot::Sender<Result<String, String>>)> = Vec::new();
    loop {
        if engine.is_idle() && updates.is_empty() {
            match rx.recv() {
                Ok(m) => accept(lm, &mut engine, &mut jobs, &mut updates, m),
                Err(_) => return,
            }
        }
        while let Ok(m) = rx.try_recv() {
            accept(lm, &mut engine, &mut jobs, &mut updates, m);
        }
        if !updates.is_empty() {
            engine.set_paused(true);
            if engine.running() == 0 {
                for (dir, reply) in updates.drain(..) {
                    let done = lm
                        .load_weights(&dir)
                        .map(|()| lm.weights_sha256())
                        .map_err(|e| format!("loading the weights of {}: {e}", dir.display()));
                    let _ = reply.send(done);
                }
                engine.set_paused(false);
            }
        }
        let gone: Vec<u64> = jobs
            .iter()
            .filter(|(_, j)| j.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            cancel(&mut engine, &mut jobs, id);
        }
        match engine.step() {
            Ok(events) => {
                for e in events {
                    let id = e.request;
                    let done = e.finish.is_some();
                    if let Some(job) = jobs.get(&id) {
                        let sent = job.events.send((job.tag, Event::Token(e)));
                        if sent.is_err() && !done {
                            cancel(&mut engine, &mut jobs, id);
                            continue;
                        }
                    }
                    if done {
                        jobs.remove(&id);
                    }
                }
            }
            Err(e) => {
                tracing::error!("serve: the engine failed: {e}");
                for (_, job) in jobs.drain() {
                    let _ = job.events.send((job.tag, Event::Failed(e.to_string())));
                }
                match Engine::new(lm, max_rows) {
                    Ok(fresh) => engine = fresh,
                    Err(e) => {
                        tracing::error!("serve: cannot restart the engine: {e}");
                        return;
                    }
                }
            }
        }
    }
}

fn accept(
    lm: &CausalLm,
    engine: &mut Engine<'_>,
    jobs: &mut HashMap<u64, Job>,
    updates: &mut Vec<(PathBuf, oneshot::Sender<Result<String, String>>)>,
    m: Msg,
) {
    match m {
        Msg::UpdateWeights { dir, reply } => updates.push((dir, reply)),
        Msg::Checksum(reply) => {
            let _ = reply.send(lm.weights_sha256());
        }
        Msg::Submit {
            key,
            tag,
            prompt,
            params,
            events,
        } => match engine.submit(prompt, params) {
            Ok(id) => {
                jobs.insert(id, Job { key, tag, events });
            }
            Err(e) => {
                let _ = events.send((tag, Event::Failed(e.to_string())));
            }
        },
        Msg::Cancel(key) => {
            if let Some(id) = jobs.iter().find(|(_, j)| j.key == key).map(|(&id, _)| id) {
                cancel(engine, jobs, id);
            }
        }
    }
}

fn cancel(engine: &mut Engine<'_>, jobs: &mut HashMap<u64, Job>, id: u64) {
    jobs.remove(&id);
    if let Err(e) = engine.cancel(id) {
        tracing::warn!("serve: cancelling request {id}: {e}");
    }
}
