//! The harness's own small trainer: REINFORCE with a moving-average baseline on a seeded
//! contextual bandit, a linear softmax policy in tch, a hand-written AdamW whose moments are
//! checkpointed, a warm-up + cosine LR schedule, and a ChaCha8 data/sampling stream whose
//! position is checkpointed, so resume is exact. Seconds on CPU: the harness's tests and the
//! quickstart use it to exercise the store, resume, sweeps, compare and the tracker.

use std::path::Path;

use anyhow::{Result, bail};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rl_core::{Sample, StepMetrics, Trainer};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// The `[bandit]` group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BanditConfig {
    /// Actions (>= 2). Default 4.
    pub arms: i64,
    /// Context features (>= 1). Default 8.
    pub features: i64,
    /// Contexts per step (>= 1). Default 64.
    pub batch_size: i64,
    /// Peak learning rate (> 0). Default 0.05.
    pub lr: f64,
    /// AdamW's decoupled weight decay (>= 0). Default 0.01.
    pub weight_decay: f64,
    /// AdamW's beta1, in [0, 1). Default 0.9.
    pub beta1: f64,
    /// AdamW's beta2, in [0, 1). Default 0.999.
    pub beta2: f64,
    /// Linear warm-up steps before the cosine decay. Default 0.
    pub warmup_steps: u64,
    /// Steps per epoch, for `trainer.total_epochs` (>= 1). Default 50.
    pub steps_per_epoch: u64,
    /// Held-out contexts scored greedily by `validate` (>= 1). Default 256.
    pub val_size: i64,
    /// Milliseconds to sleep inside each step (tests use it to interrupt a run mid-step).
    /// Default 0.
    pub step_delay_ms: u64,
    /// Milliseconds to sleep inside each validation (tests use it to stop a run before its
    /// first step). Default 0.
    pub val_delay_ms: u64,
    /// Fault injection for tests: from this step on (1-based) the weights are NaN before the
    /// step, as in a diverged run. 0 (the default) never.
    pub diverge_at_step: u64,
}

impl Default for BanditConfig {
    fn default() -> Self {
        BanditConfig {
            arms: 4,
            features: 8,
            batch_size: 64,
            lr: 0.05,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            warmup_steps: 0,
            steps_per_epoch: 50,
            val_size: 256,
            step_delay_ms: 0,
            val_delay_ms: 0,
            diverge_at_step: 0,
        }
    }
}

impl BanditConfig {
    /// Range checks; messages name the key.
    pub fn validate(&self) -> Result<()> {
        let checks: [(&str, bool, String); 8] = [
            ("bandit.arms", self.arms >= 2, self.arms.to_string()),
            (
                "bandit.features",
                self.features >= 1,
                self.features.to_string(),
            ),
            (
                "bandit.batch_size",
                self.batch_size >= 1,
                self.batch_size.to_string(),
            ),
            (
                "bandit.lr",
                self.lr > 0.0 && self.lr.is_finite(),
                self.lr.to_string(),
            ),
            (
                "bandit.weight_decay",
                self.weight_decay >= 0.0,
                self.weight_decay.to_string(),
            ),
            (
                "bandit.beta1",
                (0.0..1.0).contains(&self.beta1),
                self.beta1.to_string(),
            ),
            (
                "bandit.beta2",
                (0.0..1.0).contains(&self.beta2),
                self.beta2.to_string(),
            ),
            (
                "bandit.val_size",
                self.val_size >= 1,
                self.val_size.to_string(),
            ),
        ];
        for (key, ok, got) in checks {
            if !ok {
                bail!("config key `{key}`: out of range, got {got} (see the key's doc)");
            }
        }
        if self.steps_per_epoch == 0 {
            bail!("config key `bandit.steps_per_epoch`: must be at least 1");
        }
        Ok(())
    }
}

/// The trainer. See the module doc.
pub struct BanditTrainer {
    cfg: BanditConfig,
    device: Device,
    total: u64,
    step: u64,
    /// Policy weights `[features, arms]`.
    w: Tensor,
    /// AdamW first and second moments, `[features, arms]`.
    m: Tensor,
    v: Tensor,
    /// Moving-average reward baseline.
    baseline: f64,
    /// The data and action-sampling stream.
    rng: ChaCha8Rng,
    /// The environment's hidden best-arm weights `[features, arms]` (a function of the seed).
    truth: Tensor,
    /// Held-out contexts `[val_size, features]` (a function of the seed).
    val_x: Tensor,
    /// The reference policy's weights (the initial ones), for the KL penalty.
    w_ref: Tensor,
    /// Coefficient of `KL(policy || reference)` in the loss (`algorithm.kl_ctrl.kl_coef`).
    kl_coef: f64,
}

fn stream(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    rng
}

/// Standard normals by Box-Muller from the stream (no libtorch RNG, so nothing global).
fn normals(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
            let u2: f64 = rng.random::<f64>();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

fn role_err(msg: String) -> rl_core::Error {
    rl_core::Error::Role {
        role: "bandit trainer",
        source: msg.into(),
    }
}

fn io_err(path: &Path, source: std::io::Error) -> rl_core::Error {
    rl_core::Error::Io {
        path: path.display().to_string(),
        source,
    }
}

#[derive(Serialize, Deserialize)]
struct State {
    step: u64,
    /// f64 bit patterns keep the baseline exact through JSON.
    baseline_bits: u64,
    rng_word_pos: String,
}

impl BanditTrainer {
    /// A fresh trainer for `total` steps, every stream derived from `seed`; `kl_coef` weighs a
    /// KL penalty towards the initial policy.
    pub fn new(
        cfg: &BanditConfig,
        seed: u64,
        total: u64,
        kl_coef: f64,
        device: Device,
    ) -> Result<Self> {
        cfg.validate()?;
        let (f, a) = (cfg.features, cfg.arms);
        let mut env_rng = stream(seed, 1);
        let opts = (Kind::Float, device);
        let truth = Tensor::from_slice(&normals(&mut env_rng, (f * a) as usize))
            .view([f, a])
            .to_device(device);
        let val_x = Tensor::from_slice(&normals(&mut env_rng, (cfg.val_size * f) as usize))
            .view([cfg.val_size, f])
            .to_device(device);
        let mut init_rng = stream(seed, 2);
        let w = (Tensor::from_slice(&normals(&mut init_rng, (f * a) as usize)).view([f, a]) * 0.01)
            .to_device(device)
            .set_requires_grad(true);
        let w_ref = w.detach().copy();
        Ok(BanditTrainer {
            w_ref,
            kl_coef,
            cfg: cfg.clone(),
            device,
            total,
            step: 0,
            w,
            m: Tensor::zeros([f, a], opts),
            v: Tensor::zeros([f, a], opts),
            baseline: 0.0,
            rng: stream(seed, 3),
            truth,
            val_x,
        })
    }

    fn lr_at(&self, step: u64) -> f64 {
        let warm = self.cfg.warmup_steps;
        if step < warm {
            return self.cfg.lr * (step + 1) as f64 / warm as f64;
        }
        let span = self.total.saturating_sub(warm).max(1) as f64;
        let progress = ((step - warm) as f64 / span).min(1.0);
        self.cfg.lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

impl Trainer for BanditTrainer {
    fn global_step(&self) -> u64 {
        self.step
    }

    fn total_steps(&self) -> u64 {
        self.total
    }

    fn step(&mut self) -> rl_core::Result<StepMetrics> {
        if self.cfg.step_delay_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(self.cfg.step_delay_ms));
        }
        if self.cfg.diverge_at_step > 0 && self.step + 1 >= self.cfg.diverge_at_step {
            tch::no_grad(|| {
                let _ = self.w.fill_(f64::NAN);
            });
        }
        let (b, f, a) = (self.cfg.batch_size, self.cfg.features, self.cfg.arms);
        let x = Tensor::from_slice(&normals(&mut self.rng, (b * f) as usize))
            .view([b, f])
            .to_device(self.device);
        let logp = x.mm(&self.w).log_softmax(-1, Kind::Float);
        let probs: Vec<f32> =
            Vec::<f32>::try_from(logp.exp().detach().to_device(Device::Cpu).view([-1]))
                .map_err(|e| role_err(format!("reading probabilities: {e}")))?;
        // Inverse-CDF sampling with the stream's uniforms.
        let actions: Vec<i64> = probs
            .chunks(a as usize)
            .map(|row| {
                let u: f32 = self.rng.random::<f32>();
                let mut acc = 0.0;
                for (i, p) in row.iter().enumerate() {
                    acc += p;
                    if u < acc {
                        return i as i64;
                    }
                }
                a - 1
            })
            .collect();
        let actions = Tensor::from_slice(&actions).to_device(self.device);
        let best = x.mm(&self.truth).argmax(-1, false);
        let reward = actions.eq_tensor(&best).to_kind(Kind::Float);
        let reward_mean = reward.mean(Kind::Float).double_value(&[]);
        let adv = &reward - self.baseline;
        let chosen = logp.gather(1, &actions.unsqueeze(1), false).squeeze_dim(1);
        let ref_logp = x.mm(&self.w_ref).log_softmax(-1, Kind::Float);
        let kl = (logp.exp() * (&logp - ref_logp))
            .sum_dim_intlist(-1, false, Kind::Float)
            .mean(Kind::Float);
        let pg_loss = -(adv * &chosen).mean(Kind::Float);
        let loss = &pg_loss + &kl * self.kl_coef;
        let entropy = -(logp.exp() * &logp)
            .sum_dim_intlist(-1, false, Kind::Float)
            .mean(Kind::Float);
        self.w.zero_grad();
        loss.backward();
        let grad = self.w.grad();
        let grad_norm = grad.norm().double_value(&[]);
        let lr = self.lr_at(self.step);
        let t = (self.step + 1) as i32;
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        tch::no_grad(|| {
            self.m = &self.m * b1 + &grad * (1.0 - b1);
            self.v = &self.v * b2 + grad.square() * (1.0 - b2);
            let m_hat = &self.m / (1.0 - b1.powi(t));
            let v_hat = &self.v / (1.0 - b2.powi(t));
            let update = m_hat / (v_hat.sqrt() + 1e-8) + &self.w * self.cfg.weight_decay;
            let _ = self.w.f_sub_(&(update * lr));
        });
        self.baseline = 0.9 * self.baseline + 0.1 * reward_mean;
        self.step += 1;
        let mut m = StepMetrics::new();
        m.insert("actor/pg_loss".into(), pg_loss.double_value(&[]));
        m.insert("actor/kl_loss".into(), kl.double_value(&[]));
        m.insert("actor/entropy".into(), entropy.double_value(&[]));
        m.insert("actor/grad_norm".into(), grad_norm);
        m.insert("actor/lr".into(), lr);
        m.insert("critic/score/mean".into(), reward_mean);
        m.insert("training/baseline".into(), self.baseline);
        Ok(m)
    }

    fn validate(&mut self) -> rl_core::Result<(StepMetrics, Vec<Sample>)> {
        if self.cfg.val_delay_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(self.cfg.val_delay_ms));
        }
        let greedy = tch::no_grad(|| self.val_x.mm(&self.w).argmax(-1, false));
        let best = self.val_x.mm(&self.truth).argmax(-1, false);
        let score = greedy
            .eq_tensor(&best)
            .to_kind(Kind::Float)
            .mean(Kind::Float)
            .double_value(&[]);
        let mut m = StepMetrics::new();
        m.insert("val/test_score".into(), score);
        let samples = (0..3.min(self.cfg.val_size))
            .map(|i| Sample {
                prompt: format!("context {i}"),
                response: format!("arm {}", greedy.int64_value(&[i])),
                score: f64::from(u8::from(greedy.int64_value(&[i]) == best.int64_value(&[i]))),
                data_source: "bandit".into(),
            })
            .collect();
        Ok((m, samples))
    }

    fn save_checkpoint(&self, dir: &Path) -> rl_core::Result<()> {
        let tensors = dir.join("trainer.ot");
        Tensor::save_multi(&[("w", &self.w), ("m", &self.m), ("v", &self.v)], &tensors)?;
        let state = State {
            step: self.step,
            baseline_bits: self.baseline.to_bits(),
            rng_word_pos: self.rng.get_word_pos().to_string(),
        };
        let path = dir.join("trainer.json");
        let json = serde_json::to_vec_pretty(&state).map_err(|e| role_err(e.to_string()))?;
        std::fs::write(&path, json).map_err(|e| io_err(&path, e))
    }

    fn load_checkpoint(&mut self, dir: &Path) -> rl_core::Result<()> {
        let path = dir.join("trainer.json");
        let text = std::fs::read(&path).map_err(|e| io_err(&path, e))?;
        let state: State = serde_json::from_slice(&text)
            .map_err(|e| role_err(format!("{}: {e}", path.display())))?;
        let tensors = Tensor::load_multi_with_device(dir.join("trainer.ot"), self.device)?;
        for (name, t) in tensors {
            let target = match name.as_str() {
                "w" => &mut self.w,
                "m" => &mut self.m,
                "v" => &mut self.v,
                other => {
                    return Err(role_err(format!(
                        "unexpected tensor `{other}` in checkpoint"
                    )));
                }
            };
            if t.size() != target.size() {
                return Err(rl_core::Error::Shape {
                    key: name,
                    expected: format!("{:?}", target.size()),
                    got: t.size(),
                });
            }
            tch::no_grad(|| target.copy_(&t));
        }
        self.step = state.step;
        self.baseline = f64::from_bits(state.baseline_bits);
        let pos: u128 = state
            .rng_word_pos
            .parse()
            .map_err(|e| role_err(format!("{}: rng_word_pos: {e}", path.display())))?;
        self.rng.set_word_pos(pos);
        Ok(())
    }
}
