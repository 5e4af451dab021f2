//! Question answering exact match: verl's `search_r1_like_qa_em.py` (SQuAD normalisation), its
//! `compute_score` (exact match) and `compute_score_subem` (substring match). Whitespace is
//! Python's (`str.split()`, `str.strip()`), which also counts U+001C..U+001F.

use std::sync::LazyLock;

use regex::Regex;

use super::{RewardOutput, py_split_whitespace, py_strip};

static ARTICLES: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b(a|an|the)\b").expect("static regex"));
static ANSWER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)<answer>(.*?)</answer>").expect("static regex"));

/// SQuAD's `normalize_answer`: lower case, drop ASCII punctuation, drop articles, squeeze
/// whitespace (Python's).
pub fn normalize_answer(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punc: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    let no_articles = ARTICLES.replace_all(&no_punc, " ");
    py_split_whitespace(&no_articles)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Does `prediction` equal one of `golden` after normalisation?
pub fn em_check(prediction: &str, golden: &[String]) -> bool {
    let p = normalize_answer(prediction);
    golden.iter().any(|g| normalize_answer(g) == p)
}

/// Does a normalised target occur in the normalised `prediction` (verl's `subem_check`)?
pub fn subem_check(prediction: &str, golden: &[String]) -> bool {
    let p = normalize_answer(prediction);
    golden.iter().any(|g| p.contains(&normalize_answer(g)))
}

/// The last `<answer>...</answer>`, stripped.
pub fn extract_solution(solution: &str) -> Option<String> {
    ANSWER
        .captures_iter(solution)
        .last()
        .map(|c| py_strip(&c[1]).to_string())
}

/// verl's `search_r1_like_qa_em.compute_score`: `score` on an exact match (a quarter of it
/// when the response has more than 10 answer tags), `format_score` on a miss, 0 without an
/// answer.
pub fn compute_score(
    solution: &str,
    golden: &[String],
    format_score: f64,
    score: f64,
) -> RewardOutput {
    let answer = extract_solution(solution);
    let hit = answer.as_deref().is_some_and(|a| em_check(a, golden));
    let open = solution.matches("<answer>").count();
    let close = solution.matches("</answer>").count();
    let value = match &answer {
        None => 0.0,
        Some(_) if hit && (open > 10 || close > 10) => score / 4.0,
        Some(_) if hit => score,
        Some(_) => format_score,
    };
    RewardOutput::new(value)
        .with("acc", hit)
        .with("pred", answer)
}

/// verl's `search_r1_like_qa_em.compute_score_subem`: `score` when a target is a substring of
/// the answer (after normalisation), `format_score` on a miss, 0 without an answer.
pub fn compute_score_subem(
    solution: &str,
    golden: &[String],
    format_score: f64,
    score: f64,
) -> RewardOutput {
    let answer = extract_solution(solution);
    let hit = answer.as_deref().is_some_and(|a| subem_check(a, golden));
    let value = match &answer {
        None => 0.0,
        Some(_) if hit => score,
        Some(_) => format_score,
    };
    RewardOutput::new(value)
        .with("acc", hit)
        .with("pred", answer)
}
