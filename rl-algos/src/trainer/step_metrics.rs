//! verl's step metrics that need more than one phase's figures: the per-token timings and the
//! time per step (`compute_timing_metrics`, `compute_throughout_metrics`) and the gradient
//! variance proxies (`compute_variance_proxy_metrics`). Each is split into what one rank
//! computes from its rows (means over rows, which the ranks combine weighted by rows) and what
//! is computed once the step's figures are global (ratios of global totals).

use rl_core::{Batch, StepMetrics, keys};
use tch::{Kind, Tensor};

/// The phases verl divides by the response tokens (`gen`) or by all tokens (the others).
const PER_TOKEN_PHASES: [(&str, bool); 6] = [
    ("gen", true),
    ("ref", false),
    ("values", false),
    ("adv", false),
    ("update_critic", false),
    ("update_actor", false),
];

/// A batch's sizes for the per-token timings and the variance proxy: prompt tokens, response
/// tokens (both from the attention mask, as verl counts them) and rows. Summed over the ranks
/// by the caller under data parallelism.
pub(crate) fn batch_sizes(batch: &Batch) -> rl_core::Result<[f64; 3]> {
    let attention = batch.get(keys::ATTENTION_MASK)?;
    let width = batch.get(keys::RESPONSES)?.size()[1];
    let columns = attention.size()[1];
    let sum = |t: Tensor| t.sum(Kind::Double).double_value(&[]);
    Ok([
        sum(attention.narrow(1, 0, columns - width)),
        sum(attention.narrow(1, columns - width, width)),
        batch.len() as f64,
    ])
}

/// Adds verl's `perf/time_per_step` and `timing_per_token_ms/<phase>` (milliseconds per
/// response token for `gen`, per prompt and response token for `ref`, `values`, `adv`,
/// `update_critic` and `update_actor`, each where the step ran the phase) from the step's
/// `timing_s/*` and the global batch's `[prompt tokens, response tokens, rows]`.
pub(crate) fn add_per_token_timings(m: &mut StepMetrics, [prompt, response, _]: [f64; 3]) {
    if let Some(&step) = m.get("timing_s/step") {
        m.insert("perf/time_per_step".into(), step);
    }
    for (phase, response_only) in PER_TOKEN_PHASES {
        let tokens = if response_only {
            response
        } else {
            prompt + response
        };
        if let Some(&s) = m.get(&format!("timing_s/{phase}"))
            && tokens > 0.0
        {
            m.insert(format!("timing_per_token_ms/{phase}"), s * 1000.0 / tokens);
        }
    }
}

const TOTAL_POWER: &str = "variance_proxy/proxy2_total_power";

/// verl's variance proxy over this rank's rows, when the batch holds `sum_pi_squared` (the
/// optimal token baselines' estimators), `old_log_probs` and `advantages`: per response the
/// score-norm proxy `W = Σ_t (1 - 2π_t + Σπ²)` (times the rollout importance weight squared
/// where the batch has `rollout_is_weights`) and the mean advantage `A` over its tokens, then
/// the row means `E[A²]` (`expected_a_squared`), `E[W]` (`expected_w`) and the total power
/// `E[A² max(W, 0)]` (off-policy, with importance weights: `E[ρ̄² A² max(W/ρ², 0)]`, `ρ̄` the
/// response's mean weight). The tokens are the policy's (`response_mask`, observations
/// excluded). [`finish_variance_proxy`] adds the rest once the figures are global.
pub(crate) fn variance_proxy(batch: &Batch) -> rl_core::Result<Option<StepMetrics>> {
    let (Ok(spp), Ok(old), Ok(adv)) = (
        batch.get(keys::SUM_PI_SQUARED),
        batch.get(keys::OLD_LOG_PROBS),
        batch.get(keys::ADVANTAGES),
    ) else {
        return Ok(None);
    };
    let double = |t: &Tensor| t.to_kind(Kind::Double);
    let mask = double(&keys::policy_mask(batch)?);
    let row_sum = |t: &Tensor| t.sum_dim_intlist([-1].as_slice(), false, Kind::Double);
    // verl_F.masked_mean / masked_sum along the tokens
    let masked_mean = |t: &Tensor| row_sum(&(t * &mask)) / (row_sum(&mask) + 1e-8);
    let masked_sum = |t: &Tensor| row_sum(&(t * &mask));
    let mut w_t = 1.0 - 2.0 * double(old).exp() + double(spp);
    let weights = batch.get(keys::ROLLOUT_IS_WEIGHTS).ok().map(double);
    if let Some(rho) = &weights {
        w_t *= rho.square();
    }
    let a = masked_mean(&double(adv));
    let w = masked_sum(&w_t);
    let a2 = a.square();
    let total_power = match &weights {
        None => (&a2 * w.clamp_min(0.0)).mean(Kind::Double),
        Some(rho) => {
            let rho_bar = masked_mean(rho);
            let w_original = masked_sum(&(&w_t / rho.square().clamp_min(1e-10))).clamp_min(0.0);
            (rho_bar.square() * &a2 * w_original).mean(Kind::Double)
        }
    };
    let value = |t: Tensor| t.double_value(&[]);
    Ok(Some(StepMetrics::from([
        (TOTAL_POWER.to_owned(), value(total_power)),
        (
            "variance_proxy/expected_a_squared".to_owned(),
            value(a2.mean(Kind::Double)),
        ),
        (
            "variance_proxy/expected_w".to_owned(),
            value(w.mean(Kind::Double)),
        ),
    ])))
}

/// The variance proxy's figures that need the global batch, where [`variance_proxy`]'s are in
/// `m`: the signal strength `‖ḡ‖²` (`actor/grad_norm` squared; 0 when the actor did not update)
/// and the pure noise `max(0, (total power - signal) / (N - 1))` over the global batch's `N`
/// responses (0 for one response), as verl.
pub(crate) fn finish_variance_proxy(m: &mut StepMetrics, [_, _, rows]: [f64; 3]) {
    let Some(&total_power) = m.get(TOTAL_POWER) else {
        return;
    };
    let signal = m.get("actor/grad_norm").map(|g| g * g);
    let noise = match signal {
        Some(s) if rows > 1.0 => ((total_power - s) / (rows - 1.0)).max(0.0),
        _ => 0.0,
    };
    m.insert(
        "variance_proxy/proxy1_signal_strength".into(),
        signal.unwrap_or(0.0),
    );
    m.insert("variance_proxy/proxy3_pure_noise".into(), noise);
}

#[cfg(test)]
mod tests {
    use super::*;

    type Rows = [[f32; 2]; 2];

    /// Two responses of two tokens: `[old_log_probs, sum_pi_squared, advantages, response_mask]`.
    fn batch([old, spp, adv, mask]: [Rows; 4], weights: Option<Rows>) -> Batch {
        let t = |rows: Rows| Tensor::from_slice(rows.as_flattened()).view([2, 2]);
        let mut b = Batch::new();
        b.insert(keys::OLD_LOG_PROBS, t(old)).unwrap();
        b.insert(keys::SUM_PI_SQUARED, t(spp)).unwrap();
        b.insert(keys::ADVANTAGES, t(adv)).unwrap();
        b.insert(keys::RESPONSE_MASK, t(mask)).unwrap();
        if let Some(w) = weights {
            b.insert(keys::ROLLOUT_IS_WEIGHTS, t(w)).unwrap();
        }
        b
    }

    /// Within 1e-6 relative: the inputs pass through float32, and verl's masked mean adds 1e-8.
    fn close(m: &StepMetrics, key: &str, want: f64) {
        let got = m[key];
        assert!(
            (got - want).abs() < 1e-6 * want.abs().max(1.0),
            "{key}: {got}, want {want}"
        );
    }

    /// verl's formulas by hand on two responses (the second's last token masked): on-policy,
    /// then with importance weights, then the global figures.
    #[test]
    fn the_variance_proxy_is_verls() {
        let ln = |p: f64| p.ln() as f32;
        let rows: [Rows; 4] = [
            [[ln(0.5), ln(0.25)], [ln(0.8), ln(0.1)]],
            [[0.5, 0.25], [0.7, 0.9]],
            [[1.0, 1.0], [-2.0, 5.0]],
            [[1.0, 1.0], [1.0, 0.0]],
        ];
        // W = Σ (1 - 2π + Σπ²): row 1 (1 - 1 + 0.5) + (1 - 0.5 + 0.25) = 1.25; row 2 1 - 1.6 + 0.7
        let (w1, w2) = (1.25, 0.1);
        let (a1, a2) = (1.0, -2.0);
        let m = variance_proxy(&batch(rows, None)).unwrap().unwrap();
        close(
            &m,
            "variance_proxy/expected_a_squared",
            (a1 * a1 + a2 * a2) / 2.0,
        );
        close(&m, "variance_proxy/expected_w", (w1 + w2) / 2.0);
        close(&m, TOTAL_POWER, (a1 * a1 * w1 + a2 * a2 * w2) / 2.0);
        // importance weights: W scaled by ρ², the total power from ρ̄² and the unscaled W
        let rho = [[2.0f32, 0.5], [1.5, 9.0]];
        let m = variance_proxy(&batch(rows, Some(rho))).unwrap().unwrap();
        let w1_rho = (1.0 - 1.0 + 0.5) * 4.0 + (1.0 - 0.5 + 0.25) * 0.25;
        let w2_rho = w2 * 2.25;
        close(&m, "variance_proxy/expected_w", (w1_rho + w2_rho) / 2.0);
        let (r1, r2) = (1.25f64, 1.5f64);
        let want = (r1 * r1 * a1 * a1 * w1 + r2 * r2 * a2 * a2 * w2) / 2.0;
        close(&m, TOTAL_POWER, want);
        // the global figures: signal ‖ḡ‖², noise (total - signal) / (N - 1), never below 0
        let mut g = StepMetrics::from([
            (TOTAL_POWER.to_owned(), 3.0),
            ("actor/grad_norm".to_owned(), 1.0),
        ]);
        finish_variance_proxy(&mut g, [0.0, 0.0, 5.0]);
        close(&g, "variance_proxy/proxy1_signal_strength", 1.0);
        close(&g, "variance_proxy/proxy3_pure_noise", 0.5);
        let mut g = StepMetrics::from([
            (TOTAL_POWER.to_owned(), 3.0),
            ("actor/grad_norm".to_owned(), 2.0),
        ]);
        finish_variance_proxy(&mut g, [0.0, 0.0, 5.0]);
        close(&g, "variance_proxy/proxy3_pure_noise", 0.0);
        let mut g = StepMetrics::from([(TOTAL_POWER.to_owned(), 3.0)]);
        finish_variance_proxy(&mut g, [0.0, 0.0, 5.0]);
        close(&g, "variance_proxy/proxy1_signal_strength", 0.0);
        close(&g, "variance_proxy/proxy3_pure_noise", 0.0);
        // without sum_pi_squared: nothing
        let mut b = batch(rows, None);
        let _ = b.pop(keys::SUM_PI_SQUARED).unwrap();
        assert!(variance_proxy(&b).unwrap().is_none());
    }

    /// `gen` per response token, the other phases per prompt and response token, only the
    /// phases the step ran; `perf/time_per_step` is the step's time.
    #[test]
    fn per_token_timings_divide_by_verls_token_counts() {
        let mut m = StepMetrics::from([
            ("timing_s/step".to_owned(), 4.0),
            ("timing_s/gen".to_owned(), 2.0),
            ("timing_s/update_actor".to_owned(), 1.5),
            ("timing_s/old_log_prob".to_owned(), 0.5),
        ]);
        add_per_token_timings(&mut m, [300.0, 200.0, 8.0]);
        close(&m, "perf/time_per_step", 4.0);
        close(&m, "timing_per_token_ms/gen", 10.0);
        close(&m, "timing_per_token_ms/update_actor", 3.0);
        assert!(!m.contains_key("timing_per_token_ms/ref"));
        assert!(!m.contains_key("timing_per_token_ms/old_log_prob"));
    }
}
