//! Issue 20: verl's rollout correction in a real GRPO run through `harness train`, on the tiny
//! Llama, with the rollout's log-probs deliberately perturbed
//! (`actor_rollout_ref.rollout.debug_logprob_noise`, Gaussian, σ = 0.5): the importance
//! weights, the rejection and the diagnostics behave as verl's functions do on such a gap (the
//! functions themselves are pinned value for value by rl-algos' parity fixtures), reach the
//! loss, and land in the run store. Also bypass mode and the optimal token baseline end to end,
//! and when an on-policy update supplies the old log-probs itself (no separate forward).

mod common;

use std::collections::BTreeMap;

use common::{Env, repo_root, tiny_llm};

/// A short GRPO run from the untrained tiny Llama; returns its step metrics (step -> key ->
/// value) from the store.
fn grpo(env: &Env, name: &str, overrides: &[&str]) -> BTreeMap<i64, BTreeMap<String, f64>> {
    let file = repo_root().join("experiments/quickstart.toml");
    let name_kv = format!("trainer.experiment_name={name}");
    let mut args = vec![
        "train",
        file.to_str().unwrap(),
        "actor_rollout_ref.model.path=models/tiny-llama",
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.response_length=6",
        "actor_rollout_ref.rollout.temperature=1.0",
        &name_kv,
    ];
    args.extend_from_slice(overrides);
    env.ok(&args);
    let (rt, store) = env.store();
    let run = rt.block_on(store.resolve_run(name)).unwrap();
    assert_eq!(run.status, "finished", "{name}");
    let mut out: BTreeMap<i64, BTreeMap<String, f64>> = BTreeMap::new();
    for (step, key, value, _) in rt.block_on(store.all_metrics(run.id)).unwrap() {
        out.entry(step).or_default().insert(key, value);
    }
    out
}

fn within(m: &BTreeMap<String, f64>, key: &str, lo: f64, hi: f64) {
    let v = *m
        .get(key)
        .unwrap_or_else(|| panic!("no {key} in {:?}", m.keys().collect::<Vec<_>>()));
    assert!(
        (lo..=hi).contains(&v),
        "{key} = {v}, expected in [{lo}, {hi}]"
    );
}

#[test]
fn perturbed_rollout_log_probs_are_weighted_rejected_and_logged() {
    let env = Env::new();
    tiny_llm(&env, 64, 8);

    // Diagnostics only, no perturbation: the rollout's log-probs are the trainer's up to
    // float rounding (KV-cached decoding vs one forward pass).
    let clean = grpo(
        &env,
        "clean",
        &["actor_rollout_ref.rollout.calculate_log_probs=true"],
    );
    {
        let m = &clean[&1];
        within(m, "rollout_corr/k3_kl", 0.0, 1e-6);
        within(m, "rollout_corr/log_ppl_abs_diff", 0.0, 1e-4);
        within(m, "rollout_corr/training_ppl", 1.0, 1e6);
        assert!(
            !m.keys()
                .any(|k| k.contains("rollout_is_") || k.contains("rollout_rs_"))
        );
    }

    // σ = 0.5 noise on the rollout's log-probs: log_ratio = old − rollout ~ N(0, 0.25).
    // Token IS weights exp(log_ratio), capped at 2.
    let weighted = grpo(
        &env,
        "weighted",
        &[
            "actor_rollout_ref.rollout.debug_logprob_noise=0.5",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=2.0",
        ],
    );
    {
        let m = &weighted[&1];
        // E[e^x - x - 1] = e^(σ²/2) - 1 = 0.133; E[e^2x] - 1 = e^(2σ²) - 1 = 0.65
        within(m, "rollout_corr/k3_kl", 0.05, 0.3);
        within(m, "rollout_corr/chi2_token", 0.1, 2.0);
        // P(e^x > 2) = P(x > 0.69) = 0.083; capped weights keep the mean near 1
        within(
            m,
            "rollout_corr/rollout_is_ratio_fraction_high",
            0.005,
            0.25,
        );
        within(m, "rollout_corr/rollout_is_max", 2.0, 1e9);
        within(m, "rollout_corr/rollout_is_mean", 0.8, 1.4);
        within(m, "rollout_corr/rollout_is_eff_sample_size", 0.5, 1.0);
        assert!(!m.keys().any(|k| k.contains("rollout_rs_")));
    }

    // token_k1 keeps ratios in [0.8, 1.25] (|log_ratio| <= 0.223): it rejects
    // P(|N(0, .25)| > .223) = 0.66 of the tokens. The actor's diagnostics (logged last, as in
    // verl) see only the kept tokens, whose k3 is at most 0.223²/2 = 0.025.
    let rejected = grpo(
        &env,
        "rejected",
        &[
            "actor_rollout_ref.rollout.debug_logprob_noise=0.5",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.8_1.25",
        ],
    );
    {
        let m = &rejected[&1];
        within(m, "rollout_corr/rollout_rs_masked_fraction", 0.5, 0.8);
        within(
            m,
            "rollout_corr/rollout_rs_token_k1_masked_fraction",
            0.5,
            0.8,
        );
        within(
            m,
            "rollout_corr/rollout_rs_token_k1_fraction_high",
            0.2,
            0.5,
        );
        within(m, "rollout_corr/k3_kl", 0.0, 0.03);
        assert!(!m.keys().any(|k| k.contains("rollout_is_")));
    }

    // Rejecting every token (k2 above 1e-12 with this noise) leaves nothing to learn from: the
    // actor's only mini-batch holds no token and is skipped, so no loss is recorded at all.
    let all = grpo(
        &env,
        "all-rejected",
        &[
            "actor_rollout_ref.rollout.debug_logprob_noise=0.5",
            "algorithm.rollout_correction.rollout_rs=token_k2",
            "algorithm.rollout_correction.rollout_rs_threshold=1e-12",
        ],
    );
    {
        let m = &all[&1];
        within(m, "rollout_corr/rollout_rs_masked_fraction", 1.0, 1.0);
        for key in ["actor/pg_loss", "actor/kl_loss"] {
            assert!(
                !m.contains_key(key),
                "{key} recorded with every token rejected"
            );
        }
        // response lengths come from the attention mask: rejection does not shorten responses
        within(m, "response_length/mean", 1.0, 6.0);
    }
}

#[test]
fn bypass_mode_and_the_optimal_token_baseline_run_end_to_end() {
    let env = Env::new();
    tiny_llm(&env, 64, 8);
    // Bypass mode: no old-log-prob pass; REINFORCE with sequence IS weights, computed in the
    // actor's loss against the (perturbed) rollout log-probs.
    let bypass = grpo(
        &env,
        "bypass",
        &[
            "actor_rollout_ref.rollout.debug_logprob_noise=0.3",
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.loss_type=reinforce",
            "algorithm.rollout_correction.rollout_is=sequence",
            "algorithm.rollout_correction.rollout_rs=seq_max_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5",
        ],
    );
    {
        let m = &bypass[&1];
        assert!(
            !m.contains_key("timing_s/old_log_prob"),
            "bypass mode recomputed old log-probs"
        );
        within(m, "rollout_corr/rollout_is_mean", 0.0, 2.0);
        within(
            m,
            "rollout_corr/rollout_rs_seq_max_k3_masked_fraction",
            0.0,
            1.0,
        );
        within(m, "rollout_corr/k3_kl", 0.005, 1.0);
        within(m, "actor/ppo_kl", -1.0, 1.0);
    }
    // The optimal token baseline: the actor computes sum_pi_squared, the advantages are finite.
    let otb = grpo(
        &env,
        "otb",
        &["algorithm.adv_estimator=optimal_token_baseline"],
    );
    {
        let m = &otb[&1];
        assert!(m.contains_key("timing_s/old_log_prob"), "OTB reads them");
        // verl's variance proxies need sum_pi_squared: E[A² W] over the responses, and the
        // noise is (that - ‖ḡ‖²) / (N - 1), at least 0
        let signal = m["actor/grad_norm"].powi(2);
        assert_eq!(m["variance_proxy/proxy1_signal_strength"], signal);
        within(m, "variance_proxy/expected_a_squared", 0.0, 100.0);
        // each token's 1 - 2π + Σπ² is (1 - π)² plus the other tokens' π², within [0, 2]; six tokens
        within(m, "variance_proxy/expected_w", 1e-3, 12.0);
        let total = m["variance_proxy/proxy2_total_power"];
        let noise = ((total - signal) / 63.0).max(0.0);
        assert!((m["variance_proxy/proxy3_pure_noise"] - noise).abs() <= 1e-12 * noise.max(1.0));
        within(m, "critic/advantages/mean", -10.0, 10.0);
        within(m, "critic/advantages/max", -10.0, 10.0);
        within(m, "actor/pg_loss", -1e3, 1e3);
    }
    // verl's registry alias
    let alias = grpo(&env, "alias", &["algorithm.adv_estimator=grpo_vectorized"]);
    assert!(alias[&1].contains_key("critic/advantages/mean"));
    // Asking for OTB without sum_pi_squared names the key.
    let file = repo_root().join("experiments/quickstart.toml");
    let err = env.fails(&[
        "train",
        file.to_str().unwrap(),
        "algorithm.adv_estimator=tir_optimal_token_baseline",
        "actor_rollout_ref.actor.calculate_sum_pi_squared=false",
    ]);
    assert!(
        err.contains("actor_rollout_ref.actor.calculate_sum_pi_squared"),
        "{err}"
    );
}

/// An on-policy update (one mini-batch, one epoch) supplies the old log-probs itself, as verl's
/// actor takes them (the current ones, detached: the ratio is exactly 1), so the separate
/// forward is skipped unless something reads them before the update; the step's loss,
/// gradient and `actor/entropy` are those of the run that computes them apart
/// (`actor_rollout_ref.actor.old_log_prob_from_update=false`) up to rounding.
#[test]
fn an_on_policy_update_supplies_the_old_log_probs_unless_they_are_read_first() {
    let env = Env::new();
    tiny_llm(&env, 64, 8);
    let skipped = grpo(&env, "skipped", &[]);
    let apart = grpo(
        &env,
        "apart",
        &["actor_rollout_ref.actor.old_log_prob_from_update=false"],
    );
    let (s, a) = (&skipped[&1], &apart[&1]);
    assert!(!s.contains_key("timing_s/old_log_prob"), "{s:?}");
    // verl's data and timing metrics: no response is empty, so the non-aborted lengths are all
    // of them; per-token timings over the response tokens (gen) or all tokens (the updates)
    assert_eq!(s["response/aborted_ratio"], 0.0);
    for stat in ["mean", "max", "min", "clip_ratio"] {
        let key = format!("response_length_non_aborted/{stat}");
        assert_eq!(s[&key], s[&format!("response_length/{stat}")], "{key}");
    }
    within(s, "prompt_length/clip_ratio", 0.0, 1.0);
    assert_eq!(s["perf/time_per_step"], s["timing_s/step"]);
    let response_tokens = 64.0 * s["response_length/mean"];
    let all_tokens = s["perf/total_num_tokens"];
    for (phase, tokens) in [("gen", response_tokens), ("update_actor", all_tokens)] {
        let want = s[&format!("timing_s/{phase}")] * 1000.0 / tokens;
        let got = s[&format!("timing_per_token_ms/{phase}")];
        assert!(
            (got - want).abs() <= 1e-9 * want,
            "{phase}: {got} ms, want {want}"
        );
    }
    assert!(
        !s.contains_key("variance_proxy/expected_w"),
        "no sum_pi_squared"
    );
    assert!(a.contains_key("timing_s/old_log_prob"), "{a:?}");
    assert_eq!(
        s["actor/ppo_kl"], 0.0,
        "the ratio of detached log-probs is 1"
    );
    assert_eq!(s["actor/pg_clipfrac"], 0.0);
    assert!(a["actor/ppo_kl"].abs() < 1e-6, "{}", a["actor/ppo_kl"]);
    for key in [
        "actor/entropy",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/kl_loss",
    ] {
        let (x, y) = (s[key], a[key]);
        assert!(
            (x - y).abs() <= 1e-5 * y.abs().max(1e-3),
            "{key}: {x} skipping the forward, {y} with it"
        );
    }
    assert!(s["actor/entropy"] > 0.1, "{}", s["actor/entropy"]);
    // verl aggregates the metric with the loss's `loss_agg_mode`, on either path; the first
    // step's entropies are the same whatever the mode (same weights, same rollout)
    let token_mean = s["actor/entropy"];
    for (name, mode) in [
        ("seq_mean", "seq-mean-token-mean"),
        ("sum_norm", "seq-mean-token-sum-norm"),
    ] {
        let kv = format!("actor_rollout_ref.actor.loss_agg_mode={mode}");
        let skipped = &grpo(&env, &format!("skipped_{name}"), &[&kv])[&1];
        let apart = &grpo(
            &env,
            &format!("apart_{name}"),
            &[
                &kv,
                "actor_rollout_ref.actor.old_log_prob_from_update=false",
            ],
        )[&1];
        let (x, y) = (skipped["actor/entropy"], apart["actor/entropy"]);
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "{mode}: {x} skipping the forward, {y} with it"
        );
        assert!(!skipped.contains_key("timing_s/old_log_prob"), "{mode}");
        if mode == "seq-mean-token-sum-norm" {
            // Σ entropy over the batch's 64 responses' tokens / the response width (6)
            let tokens = 64.0 * skipped["response_length/mean"];
            let want = token_mean * tokens / 6.0;
            assert!(
                (x - want).abs() <= 1e-5 * want,
                "{mode}: {x}, the token mean {token_mean} x {tokens} tokens / 6 = {want}"
            );
        } else {
            assert!(x > 0.1 && (x - token_mean).abs() > 1e-6, "{mode}: {x}");
        }
    }
    // two mini-batches, two epochs, or KL in the reward: the forward runs
    for (name, overrides) in [
        (
            "two_minis",
            &["actor_rollout_ref.actor.ppo_mini_batch_size=8"][..],
        ),
        ("two_epochs", &["actor_rollout_ref.actor.ppo_epochs=2"][..]),
        (
            "kl_in_reward",
            &[
                "algorithm.use_kl_in_reward=true",
                "actor_rollout_ref.actor.use_kl_loss=false",
            ][..],
        ),
    ] {
        let m = &grpo(&env, name, overrides)[&1];
        assert!(m.contains_key("timing_s/old_log_prob"), "{name}: {m:?}");
        assert!(m.contains_key("actor/entropy"), "{name}");
    }
}
