//! Arithmetic and short word problems: the last number in the response against the answer.

use std::sync::LazyLock;

use regex::Regex;

use super::RewardOutput;

static NUMBER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"-?\d[\d,]*(?:\.\d+)?").expect("static regex"));

/// The last number in `text`, thousands separators removed.
pub fn last_number(text: &str) -> Option<String> {
    NUMBER
        .find_iter(text)
        .last()
        .map(|m| m.as_str().replace(',', ""))
}

/// 1.0 when the last number in the response equals the ground truth numerically (within 1e-6
/// of it, so `12` and `12.0` agree), else 0.0.
pub fn compute_score(solution: &str, ground_truth: &str) -> RewardOutput {
    let pred = last_number(solution);
    let truth = ground_truth.trim().replace(',', "").parse::<f64>().ok();
    let ok = match (pred.as_deref().and_then(|p| p.parse::<f64>().ok()), truth) {
        (Some(p), Some(t)) => (p - t).abs() <= 1e-6 * t.abs().max(1.0),
        _ => false,
    };
    RewardOutput::new(if ok { 1.0 } else { 0.0 })
        .with("acc", ok)
        .with("pred", pred)
}
