//! What the run-store benchmarks share: the metric keys each step logs (a PPO run's usual
//! ones, a validation score among them) and the runtime the store runs on.

/// Ten metric keys, logged at every step.
pub(crate) const KEYS: [&str; 10] = [
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "actor/kl_loss",
    "critic/score/mean",
    "training/baseline",
    "timing_s/step",
    "response_length/mean",
    "val/test_score",
];

/// A two-thread runtime, as the harness's commands use.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
