//! Criterion benchmarks of GAE, GRPO and the PPO clip loss on a `[512, 4096]` f32 batch.

use criterion::{Criterion, criterion_group, criterion_main};
use rl_algos::advantage;
use rl_algos::agg::GlobalBatchInfo;
use rl_algos::loss::{self, PolicyLossConfig, PolicyLossInputs};
use tch::{Device, Kind, Tensor};

const BATCH: i64 = 512;
const RESPONSE_LEN: i64 = 4096;
const GROUP_SIZE: i64 = 8;

fn inputs() -> (Tensor, Tensor, Tensor, Tensor) {
    tch::manual_seed(0);
    let opts = (Kind::Float, Device::Cpu);
    let lengths = Tensor::randint_low(1, RESPONSE_LEN + 1, [BATCH, 1], (Kind::Int64, Device::Cpu));
    let mask = Tensor::arange(RESPONSE_LEN, (Kind::Int64, Device::Cpu))
        .unsqueeze(0)
        .lt_tensor(&lengths)
        .to_kind(Kind::Float);
    let rewards = Tensor::randn([BATCH, RESPONSE_LEN], opts) * &mask;
    let values = Tensor::randn([BATCH, RESPONSE_LEN], opts);
    let index =
        Tensor::arange(BATCH, (Kind::Int64, Device::Cpu)).divide_scalar_mode(GROUP_SIZE, "floor");
    (rewards, values, mask, index)
}

fn bench(c: &mut Criterion) {
    tch::set_num_threads(1);
    let (rewards, values, mask, index) = inputs();
    let mut g = c.benchmark_group("rl-algos [512, 4096] f32, 1 thread");
    g.sample_size(10);

    g.bench_function("advantage::gae", |b| {
        b.iter(|| advantage::gae(&rewards, &values, &mask, 0.99, 0.95).unwrap())
    });
    g.bench_function("advantage::grpo", |b| {
        b.iter(|| advantage::grpo(&rewards, &mask, &index, true, advantage::EPSILON).unwrap())
    });

    let old = Tensor::randn([BATCH, RESPONSE_LEN], (Kind::Float, Device::Cpu)) * 0.1 - 1.0;
    let log_prob = (&old + Tensor::randn([BATCH, RESPONSE_LEN], (Kind::Float, Device::Cpu)) * 0.1)
        .set_requires_grad(true);
    let advantages = Tensor::randn([BATCH, RESPONSE_LEN], (Kind::Float, Device::Cpu));
    let cfg = PolicyLossConfig {
        clip_ratio_high: Some(0.28),
        ..PolicyLossConfig::default()
    };
    let info = GlobalBatchInfo::local();
    let run = || {
        let inputs = PolicyLossInputs {
            old_log_prob: &old,
            log_prob: &log_prob,
            advantages: &advantages,
            response_mask: &mask,
            rollout_is_weights: None,
        };
        loss::ppo_clip(&inputs, &cfg, &info).unwrap()
    };
    g.bench_function("loss::ppo_clip forward", |b| b.iter(run));
    g.bench_function("loss::ppo_clip forward+backward", |b| {
        b.iter(|| {
            let out = run();
            Tensor::run_backward(&[&out.loss], &[&log_prob], false, false)
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
