//! [`BackgroundWorker`]: the rollout of asynchronous training (issue 23). A thread owns a
//! [`RolloutWorker`] over its own replica of the policy ([`CausalLm::replica`]) and runs the
//! trainer's orders in the order they came: a weight snapshot replaces the replica's weights,
//! a prompt batch is generated with the weights the replica holds then. The actor trains its own
//! weights meanwhile; the trainer decides which snapshot each batch sees, so a run is the same
//! however the two threads are scheduled.
//!
//! Memory: one more copy of the policy's weights (as vLLM holds its own), plus a snapshot of
//! the trained variables (a LoRA policy's adapters only) for each sync not yet applied. With `rollout.server_url` the replica's rollout generates on the
//! servers, syncing them from the replica's weights.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Instant;

use rl_core::Batch;
use rl_core::roles::{BackgroundRollout, GENERATION_SECONDS, Rollout};
use tch::Tensor;

use crate::roles::actor::{RolloutWorker, SharedPolicy, lock, share};
use crate::roles::config::ValKwargs;
use crate::roles::role_err;
use crate::rollout::RolloutConfig;

/// What the trainer hands the rollout thread.
enum Order {
    /// Replace the replica's weights with these.
    Weights(Vec<(String, Tensor)>),
    /// Generate these prompts.
    Generate(Batch),
}

/// The rollout thread's answer to one [`Order::Generate`] (or a failed [`Order::Weights`],
/// reported with the next batch it spoils).
type Answer = rl_core::Result<Batch>;

/// Generation on a replica of the policy in a thread of its own (see the module docs).
pub struct BackgroundWorker {
    policy: SharedPolicy,
    orders: Option<Sender<Order>>,
    answers: Receiver<Answer>,
    thread: Option<JoinHandle<()>>,
    /// Submitted and not yet collected.
    in_flight: usize,
}

impl std::fmt::Debug for BackgroundWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackgroundWorker")
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

fn stopped() -> rl_core::Error {
    rl_core::Error::Role {
        role: "rollout",
        source: "the background rollout thread stopped (it panicked or failed to start); \
                 see the error logged before this one"
            .into(),
    }
}

impl BackgroundWorker {
    /// A rollout thread generating on a replica of `policy` as it is now, with the training
    /// and validation sampling of `cfg` and `val` (as [`RolloutWorker::new`] takes them). The
    /// thread computes with `threads` intra-op threads, or as many as the caller's when `None`
    /// (then it generates exactly what the caller's own rollout would: another thread count may
    /// round differently).
    pub fn new(
        policy: &SharedPolicy,
        cfg: RolloutConfig,
        val: ValKwargs,
        eos_token_ids: Vec<i64>,
        pad_token_id: i64,
        threads: Option<i32>,
    ) -> rl_core::Result<Self> {
        let replica = lock(policy, "rollout")?
            .replica()
            .map_err(role_err("rollout"))?;
        let replica = share(replica);
        let mut rollout =
            RolloutWorker::new(replica.clone(), cfg, val, eos_token_ids, pad_token_id)?;
        let threads = threads.unwrap_or_else(tch::get_num_threads);
        let (orders, inbox) = channel::<Order>();
        let (outbox, answers) = channel::<Answer>();
        let thread = std::thread::Builder::new()
            .name("background-rollout".into())
            .spawn(move || {
                tch::set_num_threads(threads);
                let mut failed: Option<String> = None;
                for order in inbox {
                    match order {
                        Order::Weights(w) => {
                            let applied = lock(&replica, "rollout")
                                .and_then(|lm| lm.load_snapshot(&w).map_err(role_err("rollout")));
                            if let Err(e) = applied {
                                failed = Some(e.to_string());
                            }
                        }
                        Order::Generate(prompts) => {
                            let answer = match &failed {
                                Some(e) => Err(rl_core::Error::Role {
                                    role: "rollout",
                                    source: format!("loading the weights snapshot: {e}").into(),
                                }),
                                None => {
                                    let t = Instant::now();
                                    rollout.generate(&prompts).map(|mut b| {
                                        b.meta_info_mut().insert(
                                            GENERATION_SECONDS.into(),
                                            t.elapsed().as_secs_f64().into(),
                                        );
                                        b
                                    })
                                }
                            };
                            if outbox.send(answer).is_err() {
                                return;
                            }
                        }
                    }
                }
            })
            .map_err(|e| rl_core::Error::Role {
                role: "rollout",
                source: format!("starting the background rollout thread: {e}").into(),
            })?;
        Ok(BackgroundWorker {
            policy: policy.clone(),
            orders: Some(orders),
            answers,
            thread: Some(thread),
            in_flight: 0,
        })
    }

    fn send(&self, order: Order) -> rl_core::Result<()> {
        self.orders
            .as_ref()
            .ok_or_else(stopped)?
            .send(order)
            .map_err(|_| stopped())
    }
}

impl BackgroundRollout for BackgroundWorker {
    fn sync_weights(&mut self) -> rl_core::Result<()> {
        let snapshot = lock(&self.policy, "rollout")?
            .trained_snapshot()
            .map_err(role_err("rollout"))?;
        self.send(Order::Weights(snapshot))
    }

    fn submit(&mut self, prompts: Batch) -> rl_core::Result<()> {
        self.send(Order::Generate(prompts))?;
        self.in_flight += 1;
        Ok(())
    }

    fn collect(&mut self) -> rl_core::Result<Batch> {
        if self.in_flight == 0 {
            return Err(rl_core::Error::Role {
                role: "rollout",
                source: "collect with no batch submitted".into(),
            });
        }
        self.in_flight -= 1;
        self.answers.recv().map_err(|_| stopped())?
    }
}

impl Drop for BackgroundWorker {
    fn drop(&mut self) {
        // closing the channel ends the thread after the order it is running
        self.orders = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
