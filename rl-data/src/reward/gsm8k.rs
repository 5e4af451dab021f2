//! GSM8K: verl's `reward_score/gsm8k.py` (strict `#### N` or flexible last number).

use std::sync::LazyLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

use super::{RewardOutput, python_tail};

/// How the answer is found in the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gsm8kMethod {
    /// The last `#### N` (commas and `$` removed).
    #[default]
    Strict,
    /// The last number-like run in the text (kept as written).
    Flexible,
}

/// verl only looks at the last 300 characters.
const SOLUTION_CLIP_CHARS: usize = 300;

static STRICT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"#### (\-?[0-9\.\,]+)").expect("static regex"));
static FLEXIBLE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(\-?[0-9\.\,]+)").expect("static regex"));

/// verl's `gsm8k.extract_solution`.
pub fn extract_solution(solution: &str, method: Gsm8kMethod) -> Option<String> {
    let s = python_tail(solution, SOLUTION_CLIP_CHARS);
    match method {
        Gsm8kMethod::Strict => STRICT
            .captures_iter(s)
            .last()
            .map(|c| c[1].replace([',', '$'], "")),
        Gsm8kMethod::Flexible => {
            let all: Vec<&str> = FLEXIBLE.find_iter(s).map(|m| m.as_str()).collect();
            // Python's loop variable keeps the last value tried when nothing breaks.
            all.iter()
                .rev()
                .find(|a| !a.is_empty() && **a != ".")
                .or(all.first())
                .map(|a| a.to_string())
        }
    }
}

/// verl's `gsm8k.compute_score`: `score` when the extracted answer equals `ground_truth`,
/// `format_score` when an answer was found but differs, 0 when none was found.
pub fn compute_score(
    solution: &str,
    ground_truth: &str,
    method: Gsm8kMethod,
    format_score: f64,
    score: f64,
) -> RewardOutput {
    let answer = extract_solution(solution, method);
    let value = match &answer {
        None => 0.0,
        Some(a) if a == ground_truth => score,
        Some(_) => format_score,
    };
    RewardOutput::new(value)
        .with("acc", value == score && answer.is_some())
        .with("pred", answer)
}
