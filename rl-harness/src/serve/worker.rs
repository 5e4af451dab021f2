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
use serde_json::json;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use super::rlhf::{Op, OpReply, PauseMode, Session};

/// What a job's handler hears.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// A token (the last one carries its finish reason).
    Token(Emitted),
    /// The engine failed; the job is over.
    Failed(String),
    /// `POST /pause` (abort mode) ended the job where it was (`finish_reason: "abort"`).
    Aborted,
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
    /// One of vLLM's control-plane operations ([`super::rlhf`]).
    Control {
        op: Op,
        reply: oneshot::Sender<OpReply>,
    },
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

/// The engine thread's state besides the engine: the jobs, the updates and pauses waiting for
/// the running batch to drain, vLLM's pause mode and weight-transfer session.
struct Loop {
    /// engine request id -> job
    jobs: HashMap<u64, Job>,
    /// SGLang's `/update_weights_from_disk`, loaded once nothing runs.
    updates: Vec<(PathBuf, oneshot::Sender<Result<String, String>>)>,
    /// `POST /pause?mode=wait` calls answered once nothing runs.
    waits: Vec<oneshot::Sender<OpReply>>,
    /// Paused since `/pause` (until `/resume`): no request joins the batch, and under `keep`
    /// nothing is decoded either.
    paused: Option<PauseMode>,
    session: Session,
}

impl Loop {
    /// Nothing is decoded: the running samples are frozen (`keep`).
    fn frozen(&self) -> bool {
        self.paused == Some(PauseMode::Keep)
    }
}

fn run(lm: &CausalLm, max_rows: usize, rx: &mpsc::Receiver<Msg>) {
    let mut engine = match Engine::new(lm, max_rows) {
        Ok(e) => e,
        Err(e) => {
            tracing::error!("serve: cannot start the engine: {e}");
            return;
        }
    };
    let mut st = Loop {
        jobs: HashMap::new(),
        updates: Vec::new(),
        waits: Vec::new(),
        paused: None,
        session: Session::default(),
    };
    loop {
        let admitting = st.paused.is_none() && st.updates.is_empty();
        engine.set_paused(!admitting);
        let drained = engine.running() == 0 || st.frozen();
        let steps = !st.frozen() && (engine.running() > 0 || (admitting && engine.waiting() > 0));
        let pending = drained && !(st.updates.is_empty() && st.waits.is_empty());
        if !steps && !pending {
            match rx.recv() {
                Ok(m) => accept(lm, &mut engine, &mut st, m),
                Err(_) => return,
            }
        }
        while let Ok(m) = rx.try_recv() {
            accept(lm, &mut engine, &mut st, m);
        }
        // a frozen batch (`keep`) loads at once: its samples go on with the new weights after
        // `/resume`, as vLLM's do
        if engine.running() == 0 || st.frozen() {
            for (dir, reply) in st.updates.drain(..) {
                let done = lm
                    .load_weights(&dir)
                    .map(|()| lm.weights_sha256())
                    .map_err(|e| format!("loading the weights of {}: {e}", dir.display()));
                let _ = reply.send(done);
            }
            for reply in st.waits.drain(..) {
                let _ = reply.send(Ok(json!({"status": "paused"})));
            }
        }
        engine.set_paused(st.paused.is_some() || !st.updates.is_empty());
        let gone: Vec<u64> = st
            .jobs
            .iter()
            .filter(|(_, j)| j.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            cancel(&mut engine, &mut st.jobs, id);
        }
        if st.frozen() {
            continue;
        }
        match engine.step() {
            Ok(events) => {
                for e in events {
                    let id = e.request;
                    let done = e.finish.is_some();
                    if let Some(job) = st.jobs.get(&id) {
                        let sent = job.events.send((job.tag, Event::Token(e)));
                        if sent.is_err() && !done {
                            cancel(&mut engine, &mut st.jobs, id);
                            continue;
                        }
                    }
                    if done {
                        st.jobs.remove(&id);
                    }
                }
            }
            Err(e) => {
                tracing::error!("serve: the engine failed: {e}");
                for (_, job) in st.jobs.drain() {
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

/// vLLM's `/pause`: abort ends every request in flight now, wait answers once the running
/// samples have finished, keep freezes them; from now until `/resume` no request joins the
/// batch (new ones wait in the queue, as vLLM's scheduler holds them).
fn pause(engine: &mut Engine<'_>, st: &mut Loop, mode: PauseMode, reply: oneshot::Sender<OpReply>) {
    st.paused = Some(mode);
    engine.set_paused(true);
    match mode {
        PauseMode::Abort => {
            let ids: Vec<u64> = st.jobs.keys().copied().collect();
            for id in ids {
                if let Some(job) = st.jobs.get(&id) {
                    let _ = job.events.send((job.tag, Event::Aborted));
                }
                cancel(engine, &mut st.jobs, id);
            }
            let _ = reply.send(Ok(json!({"status": "paused"})));
        }
        PauseMode::Wait => st.waits.push(reply),
        PauseMode::Keep => {
            let _ = reply.send(Ok(json!({"status": "paused"})));
        }
    }
}

fn accept(lm: &CausalLm, engine: &mut Engine<'_>, st: &mut Loop, m: Msg) {
    let jobs = &mut st.jobs;
    match m {
        Msg::UpdateWeights { dir, reply } => st.updates.push((dir, reply)),
        Msg::Control { op, reply } => match op {
            Op::Pause(mode) => pause(engine, st, mode, reply),
            Op::Resume => {
                st.paused = None;
                // a wait still draining is answered: the pause it asked for is over
                for w in st.waits.drain(..) {
                    let _ = w.send(Ok(json!({"status": "paused"})));
                }
                let _ = reply.send(Ok(json!({"status": "resumed"})));
            }
            Op::IsPaused => {
                let _ = reply.send(Ok(json!({"is_paused": st.paused.is_some()})));
            }
            op => {
                let _ = reply.send(st.session.apply(lm, op));
            }
        },
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
