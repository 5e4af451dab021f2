//! The engine against `generate` on each prompt alone, on a tiny random model.

use std::collections::BTreeMap;

use tch::{Device, Kind, Tensor};

use super::*;
use crate::model::Config;
use crate::rollout::{GenerateOptions, generate};

fn lm() -> CausalLm {
    crate::seeded(11, || {
        CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap()
    })
}

/// `generate` on `prompt` alone (no padding): its tokens and log-probs.
fn alone(lm: &CausalLm, prompt: &[i64], p: &SamplingParams) -> (Vec<i64>, Vec<f32>) {
    let len = prompt.len() as i64;
    let ids = Tensor::from_slice(prompt).view([1, len]);
    let mask = Tensor::ones([1, len], (Kind::Int64, Device::Cpu));
    let pos = Tensor::arange(len, (Kind::Int64, Device::Cpu)).view([1, len]);
    let cfg = p.rollout();
    let mut opts = GenerateOptions::from_config(lm.config());
    opts.eos_token_ids = p.stop_token_ids.clone();
    opts.seed = p.seed;
    let out = generate(lm, &ids, &mask, &pos, &cfg, &mut opts).unwrap();
    let n = out.response_mask.sum(Kind::Float).int64_value(&[]);
    let tokens = Vec::<i64>::try_from(&out.responses.narrow(1, 0, n).view([-1])).unwrap();
    let lps = Vec::<f32>::try_from(&out.rollout_log_probs.narrow(1, 0, n).view([-1])).unwrap();
    (tokens, lps)
}

type Outputs = BTreeMap<u64, (Vec<i64>, Vec<f32>, Option<Finish>)>;

/// Runs the engine until idle, submitting `later` after `after` steps; every request's tokens,
/// log-probs and finish.
fn run(
    engine: &mut Engine<'_>,
    first: &[(Vec<i64>, SamplingParams)],
    later: &[(Vec<i64>, SamplingParams)],
    after: usize,
) -> (Vec<u64>, Outputs) {
    let mut ids: Vec<u64> = first
        .iter()
        .map(|(p, s)| engine.submit(p.clone(), s.clone()).unwrap())
        .collect();
    let mut out = Outputs::new();
    let mut steps = 0;
    while !engine.is_idle() || steps <= after {
        if steps == after {
            ids.extend(
                later
                    .iter()
                    .map(|(p, s)| engine.submit(p.clone(), s.clone()).unwrap()),
            );
        }
        for e in engine.step().unwrap() {
            let entry = out.entry(e.request).or_default();
            assert!(
                entry.2.is_none(),
                "request {} emitted after finishing",
                e.request
            );
            entry.0.push(e.token);
            entry.1.push(e.log_prob);
            entry.2 = e.finish;
        }
        steps += 1;
        assert!(steps < 1000, "the engine never went idle");
    }
    (ids, out)
}

fn assert_like_alone(
    lm: &CausalLm,
    requests: &[(Vec<i64>, SamplingParams)],
    ids: &[u64],
    out: &Outputs,
) {
    for ((prompt, params), id) in requests.iter().zip(ids) {
        let (tokens, lps) = alone(lm, prompt, params);
        let (got, got_lps, finish) = &out[id];
        assert_eq!(got, &tokens, "request {id} ({prompt:?}, {params:?})");
        for (a, b) in got_lps.iter().zip(&lps) {
            assert!((a - b).abs() < 1e-4, "request {id}: log-prob {a} vs {b}");
        }
        let want = if tokens.len() as i64 == params.max_tokens
            && !params.stop_token_ids.contains(tokens.last().unwrap())
        {
            Finish::Length
        } else {
            Finish::Stop
        };
        assert_eq!(*finish, Some(want), "request {id}");
    }
}

fn prompts() -> Vec<Vec<i64>> {
    vec![
        vec![5, 17, 42],
        vec![9, 9, 100, 3, 77, 12, 40, 2],
        vec![64],
        vec![31, 8, 8, 120, 55],
        vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        vec![99, 98],
    ]
}

#[test]
fn greedy_requests_joining_a_running_batch_get_generates_tokens() {
    let lm = lm();
    let greedy = |max_tokens| SamplingParams {
        max_tokens,
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let all: Vec<(Vec<i64>, SamplingParams)> = prompts()
        .into_iter()
        .zip([12, 5, 20, 9, 3, 16])
        .map(|(p, m)| (p, greedy(m)))
        .collect();
    // a stop token that request 0 produces mid-way
    let (free, _) = alone(&lm, &all[0].0, &all[0].1);
    let mut all = all;
    all[0].1.stop_token_ids = vec![free[4]];
    let (first, later) = all.split_at(3);
    // room for 4: the later ones queue, join as rows finish, and one joins a longer batch
    let mut engine = Engine::new(&lm, 4).unwrap();
    let (ids, out) = run(&mut engine, first, later, 2);
    assert_like_alone(&lm, &all, &ids, &out);
    assert!(out[&ids[0]].0.len() <= 5, "the stop token ends request 0");
    assert!(engine.cache.is_none() && engine.mask.is_none());
}

#[test]
fn seeded_sampling_with_mixed_settings_matches_generate_alone() {
    let lm = lm();
    let settings = [
        (0.7, 5, 1.0),
        (1.0, -1, 0.9),
        (1.3, 20, 0.95),
        (0.0, -1, 1.0),
        (1.0, -1, 1.0),
        (0.9, 3, 0.5),
    ];
    let all: Vec<(Vec<i64>, SamplingParams)> = prompts()
        .into_iter()
        .zip(settings)
        .enumerate()
        .map(|(i, (p, (temperature, top_k, top_p)))| {
            let params = SamplingParams {
                max_tokens: 6 + 2 * i as i64,
                temperature,
                top_k,
                top_p,
                seed: 1000 + i as u64,
                stream: 0,
                stop_token_ids: Vec::new(),
            };
            (p, params)
        })
        .collect();
    let (first, later) = all.split_at(2);
    let mut engine = Engine::new(&lm, 8).unwrap();
    let (ids, out) = run(&mut engine, first, later, 3);
    assert_like_alone(&lm, &all, &ids, &out);
    // the same settings everywhere take the batched pick: still each request's own stream
    let same: Vec<(Vec<i64>, SamplingParams)> = all
        .iter()
        .map(|(p, s)| {
            let mut s = s.clone();
            (s.temperature, s.top_k, s.top_p) = (0.8, -1, 1.0);
            (p.clone(), s)
        })
        .collect();
    let mut engine = Engine::new(&lm, 3).unwrap();
    let (ids, out) = run(&mut engine, &same[..4], &same[4..], 1);
    assert_like_alone(&lm, &same, &ids, &out);
}

#[test]
fn a_cancelled_request_leaves_the_others_as_they_were() {
    let lm = lm();
    let params = SamplingParams {
        max_tokens: 10,
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let all: Vec<(Vec<i64>, SamplingParams)> =
        prompts().into_iter().map(|p| (p, params.clone())).collect();
    let mut engine = Engine::new(&lm, 8).unwrap();
    let ids: Vec<u64> = all
        .iter()
        .map(|(p, s)| engine.submit(p.clone(), s.clone()).unwrap())
        .collect();
    let mut out = Outputs::new();
    for step in 0..30 {
        if step == 3 {
            // the longest prompt's row: the cache's leading columns go with it
            assert!(engine.cancel(ids[4]).unwrap());
            assert!(!engine.cancel(ids[4]).unwrap(), "cancelled twice");
        }
        for e in engine.step().unwrap() {
            let entry = out.entry(e.request).or_default();
            entry.0.push(e.token);
            entry.1.push(e.log_prob);
            entry.2 = e.finish;
        }
    }
    assert!(engine.is_idle());
    assert_eq!(out[&ids[4]].0.len(), 3);
    let rest: Vec<usize> = vec![0, 1, 2, 3, 5];
    let kept: Vec<(Vec<i64>, SamplingParams)> = rest.iter().map(|&i| all[i].clone()).collect();
    let kept_ids: Vec<u64> = rest.iter().map(|&i| ids[i]).collect();
    assert_like_alone(&lm, &kept, &kept_ids, &out);
}

#[test]
fn bad_requests_name_what_is_wrong() {
    let lm = lm();
    let mut engine = Engine::new(&lm, 2).unwrap();
    let err = |prompt: Vec<i64>, p: SamplingParams| {
        engine_err(&mut Engine::new(&lm, 2).unwrap(), prompt, p)
    };
    assert!(err(vec![], SamplingParams::default()).contains("prompt"));
    assert!(err(vec![1, 500], SamplingParams::default()).contains("500"));
    let p = SamplingParams {
        max_tokens: 0,
        ..SamplingParams::default()
    };
    assert!(err(vec![1], p).contains("max_tokens"));
    let p = SamplingParams {
        top_p: 0.0,
        ..SamplingParams::default()
    };
    assert!(err(vec![1], p).contains("top_p"));
    assert!(
        Engine::new(&lm, 0)
            .unwrap_err()
            .to_string()
            .contains("max_rows")
    );
    assert!(
        engine.step().unwrap().is_empty(),
        "an idle engine emits nothing"
    );
}

fn engine_err(engine: &mut Engine<'_>, prompt: Vec<i64>, p: SamplingParams) -> String {
    engine.submit(prompt, p).unwrap_err().to_string()
}

#[test]
fn streams_zero_to_n_are_generates_n_samples_of_one_prompt() {
    let lm = lm();
    let prompt = [7i64, 70, 33, 2];
    let params = SamplingParams {
        max_tokens: 8,
        temperature: 1.0,
        seed: 42,
        ..SamplingParams::default()
    };
    let len = prompt.len() as i64;
    let ids = Tensor::from_slice(&prompt).view([1, len]);
    let mask = Tensor::ones([1, len], (Kind::Int64, Device::Cpu));
    let pos = Tensor::arange(len, (Kind::Int64, Device::Cpu)).view([1, len]);
    let mut cfg = params.rollout();
    cfg.n = 3;
    let mut opts = GenerateOptions::from_config(lm.config());
    opts.eos_token_ids = Vec::new();
    opts.seed = params.seed;
    let want = generate(&lm, &ids, &mask, &pos, &cfg, &mut opts).unwrap();
    let want = Vec::<Vec<i64>>::try_from(&want.responses).unwrap();
    let mut engine = Engine::new(&lm, 4).unwrap();
    let ids: Vec<u64> = (0..3)
        .map(|r| {
            let p = SamplingParams {
                stream: r,
                ..params.clone()
            };
            engine.submit(prompt.to_vec(), p).unwrap()
        })
        .collect();
    let mut got: BTreeMap<u64, Vec<i64>> = BTreeMap::new();
    while !engine.is_idle() {
        for e in engine.step().unwrap() {
            got.entry(e.request).or_default().push(e.token);
        }
    }
    for (r, id) in ids.iter().enumerate() {
        assert_eq!(got[id], want[r], "stream {r}");
    }
    assert_ne!(want[0], want[1], "the streams sample differently");
}

#[test]
fn a_paused_engine_finishes_its_batch_and_admits_nothing() {
    let lm = lm();
    let params = SamplingParams {
        max_tokens: 3,
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut engine = Engine::new(&lm, 4).unwrap();
    let first = engine.submit(vec![1, 2, 3], params.clone()).unwrap();
    assert_eq!(engine.step().unwrap().len(), 1);
    engine.set_paused(true);
    let second = engine.submit(vec![4, 5], params).unwrap();
    let mut seen = Vec::new();
    for _ in 0..5 {
        seen.extend(engine.step().unwrap().into_iter().map(|e| e.request));
    }
    assert_eq!(seen, vec![first, first], "only the running request goes on");
    assert_eq!((engine.running(), engine.waiting()), (0, 1));
    engine.set_paused(false);
    let resumed: Vec<u64> = engine
        .step()
        .unwrap()
        .into_iter()
        .map(|e| e.request)
        .collect();
    assert_eq!(resumed, vec![second]);
}
