//! What the run-store benchmarks share: the metric keys each step logs (a PPO run's usual
//! ones, a validation score among them).

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
