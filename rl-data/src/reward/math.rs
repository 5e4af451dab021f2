//! MATH answers: verl's `math_reward.py` (last `\boxed{}`, Hendrycks normalisation) and
//! `math_dapo.py` (Minerva `Answer:` normalisation, score ±1).
//!
//! Python's exceptions inside verl's helpers are mirrored as `None`/`Err` so the outcome is the
//! same: `strip_string` failing falls back to comparing the raw strings, `remove_boxed` failing
//! scores 0.

use std::sync::LazyLock;

use regex::Regex;

use super::{RewardOutput, python_tail};

/// verl's `last_boxed_only_string` (math_reward): the last `\boxed{...}` (or `\boxed ...` up to
/// a `$`, or `\fbox{...}`), braces balanced.
pub fn last_boxed_only_string(s: &str) -> Option<String> {
    if s.contains("\\boxed ") {
        let after = s.rsplit("\\boxed ").next().unwrap_or_default();
        return Some(format!(
            "\\boxed {}",
            after.split('$').next().unwrap_or_default()
        ));
    }
    let idx = s.rfind("\\boxed").or_else(|| s.rfind("\\fbox"))?;
    balanced_from(s, idx)
}

/// From `idx`, up to and including the brace that closes the first `{`.
fn balanced_from(s: &str, idx: usize) -> Option<String> {
    let mut depth = 0i64;
    for (off, c) in s[idx..].char_indices() {
        if c == '{' {
            depth += 1;
        }
        if c == '}' {
            depth -= 1;
            if depth == 0 {
                return Some(s[idx..idx + off + 1].to_string());
            }
        }
    }
    None
}

/// verl's `remove_boxed` (math_reward); `None` where Python's asserts fail.
pub fn remove_boxed(s: &str) -> Option<String> {
    if s.contains("\\boxed ") {
        return s.strip_prefix("\\boxed ").map(str::to_string);
    }
    s.strip_prefix("\\boxed{")?
        .strip_suffix('}')
        .map(str::to_string)
}

fn fix_fracs(string: &str) -> Option<String> {
    let substrs: Vec<&str> = string.split("\\frac").collect();
    let mut new_str = substrs[0].to_string();
    for substr in &substrs[1..] {
        new_str.push_str("\\frac");
        let chars: Vec<char> = substr.chars().collect();
        // `substr[0]` on an empty string raises IndexError in Python.
        let first = *chars.first()?;
        if first == '{' {
            new_str.push_str(substr);
        } else {
            if chars.len() < 2 {
                return Some(string.to_string());
            }
            let (a, b) = (chars[0], chars[1]);
            let post: String = chars[2..].iter().collect();
            if b != '{' {
                new_str.push_str(&format!("{{{a}}}{{{b}}}{post}"));
            } else {
                new_str.push_str(&format!("{{{a}}}{b}{post}"));
            }
        }
    }
    Some(new_str)
}

/// Is `s` what Python's `str(int(s))` would give back?
fn is_canonical_int(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" && !s.starts_with('-') || !digits.starts_with('0'))
}

fn fix_a_slash_b(string: &str) -> String {
    let parts: Vec<&str> = string.split('/').collect();
    if parts.len() != 2 {
        return string.to_string();
    }
    if is_canonical_int(parts[0]) && is_canonical_int(parts[1]) {
        format!("\\frac{{{}}}{{{}}}", parts[0], parts[1])
    } else {
        string.to_string()
    }
}

fn remove_right_units(string: &str) -> Option<String> {
    if string.contains("\\text{ ") {
        let splits: Vec<&str> = string.split("\\text{ ").collect();
        if splits.len() != 2 {
            return None;
        }
        Some(splits[0].to_string())
    } else {
        Some(string.to_string())
    }
}

fn fix_sqrt(string: &str) -> Option<String> {
    if !string.contains("\\sqrt") {
        return Some(string.to_string());
    }
    let splits: Vec<&str> = string.split("\\sqrt").collect();
    let mut new_string = splits[0].to_string();
    for split in &splits[1..] {
        let mut chars = split.chars();
        let first = chars.next()?;
        if first != '{' {
            new_string.push_str(&format!("\\sqrt{{{first}}}{}", chars.as_str()));
        } else {
            new_string.push_str("\\sqrt");
            new_string.push_str(split);
        }
    }
    Some(new_string)
}

/// verl's `strip_string` (math_reward); `None` where Python raises.
pub fn strip_string(input: &str) -> Option<String> {
    let mut s = input.replace('\n', "");
    s = s.replace("\\!", "");
    s = s.replace("\\\\", "\\");
    s = s.replace("tfrac", "frac").replace("dfrac", "frac");
    s = s.replace("\\left", "").replace("\\right", "");
    s = s.replace("^{\\circ}", "").replace("^\\circ", "");
    s = s.replace("\\$", "");
    s = remove_right_units(&s)?;
    s = s.replace("\\\\%", "").replace("\\%", "");
    s = s.replace(" .", " 0.").replace("{.", "{0.");
    if s.is_empty() {
        return Some(s);
    }
    if s.starts_with('.') {
        s = format!("0{s}");
    }
    let eq: Vec<&str> = s.split('=').collect();
    if eq.len() == 2 && eq[0].chars().count() <= 2 {
        s = eq[1].to_string();
    }
    s = fix_sqrt(&s)?;
    s = s.replace(' ', "");
    s = fix_fracs(&s)?;
    if s == "0.5" {
        s = "\\frac{1}{2}".into();
    }
    Some(fix_a_slash_b(&s))
}

/// verl's `is_equiv` (math_reward).
pub fn is_equiv(a: &str, b: &str) -> bool {
    match (strip_string(a), strip_string(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// verl's `math_reward.compute_score`: 1.0 when the last boxed answer is equivalent to the
/// ground truth, else 0.0.
pub fn compute_score(solution: &str, ground_truth: &str) -> RewardOutput {
    let pred = last_boxed_only_string(solution).and_then(|b| remove_boxed(&b));
    let ok = pred.as_deref().is_some_and(|p| is_equiv(p, ground_truth));
    RewardOutput::new(if ok { 1.0 } else { 0.0 })
        .with("acc", ok)
        .with("pred", pred)
}

// ---- math_dapo ----

const SUBSTITUTIONS: [(&str, &str); 10] = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
];

const REMOVED_EXPRESSIONS: [&str; 41] = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    "\"",
    "\\dots",
];

macro_rules! re {
    ($name:ident, $pat:expr) => {
        static $name: LazyLock<Regex> = LazyLock::new(|| Regex::new($pat).expect("static regex"));
    };
}
re!(DOLLARS, r"(.*?)(\$)(.*?)(\$)(.*)");
re!(TEXT, r"(\\text\{)(.*?)(\})");
re!(TEXTBF, r"(\\textbf\{)(.*?)(\})");
re!(OVERLINE, r"(\\overline\{)(.*?)(\})");
re!(BOXED, r"(\\boxed\{)(.*)(\})");
re!(FRAC, r"(frac)([^{])(.)");
re!(SQRT, r"(sqrt)([^{])");
re!(MINERVA_ANSWER, r"(?i)Answer\s*:\s*([^\n]+)");

/// Python's `str.isdigit()` for the characters answers contain (ASCII and other scripts'
/// decimal digits, super- and subscript digits).
fn py_isdigit(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| {
            c.is_ascii_digit()
                || matches!(
                    c,
                    '\u{00B2}' | '\u{00B3}' | '\u{00B9}' | '\u{2070}' | '\u{2074}'..='\u{2079}'
                )
                || matches!(c, '\u{2080}'..='\u{2089}')
                || is_unicode_decimal(c)
        })
}

/// Decimal digits of other scripts (Arabic-Indic, Devanagari, full-width, ...): code points
/// whose value within their block of ten is a digit.
fn is_unicode_decimal(c: char) -> bool {
    const ZEROS: [u32; 12] = [
        0x0660, 0x06F0, 0x07C0, 0x0966, 0x09E6, 0x0A66, 0x0AE6, 0x0B66, 0x0BE6, 0x0C66, 0x0CE6,
        0xFF10,
    ];
    let u = c as u32;
    ZEROS.iter().any(|&z| (z..z + 10).contains(&u))
}

/// verl's `math_dapo.normalize_final_answer` (Minerva).
pub fn normalize_final_answer(answer: &str) -> String {
    let mut s = answer.rsplit('=').next().unwrap_or_default().to_string();
    for (before, after) in SUBSTITUTIONS {
        s = s.replace(before, after);
    }
    for expr in REMOVED_EXPRESSIONS {
        s = s.replace(expr, "");
    }
    s = DOLLARS.replace_all(&s, "$$${3}$$").into_owned();
    s = TEXT.replace_all(&s, "${2}").into_owned();
    s = TEXTBF.replace_all(&s, "${2}").into_owned();
    s = OVERLINE.replace_all(&s, "${2}").into_owned();
    s = BOXED.replace_all(&s, "${2}").into_owned();
    s = FRAC.replace_all(&s, "frac{${2}}{${3}}").into_owned();
    s = SQRT.replace_all(&s, "sqrt{${2}}").into_owned();
    s = s.replace('$', "");
    if py_isdigit(&s.replace(',', "")) {
        s = s.replace(',', "");
    }
    s.trim().to_string()
}

/// verl's `math_dapo.last_boxed_only_string` (only `\boxed{`).
fn dapo_last_boxed(s: &str) -> Option<String> {
    let idx = s.rfind("\\boxed{")?;
    balanced_from(s, idx)
}

/// verl's `math_dapo.compute_score`: +1.0 when the last `Answer: ...` in the final 300
/// characters normalises to the normalised ground truth, else -1.0. With `strict_box_verify`,
/// the last `\boxed{}` in the final 100 characters must equal the ground truth exactly.
pub fn compute_score_dapo(
    solution: &str,
    ground_truth: &str,
    strict_box_verify: bool,
) -> RewardOutput {
    let solution = python_tail(solution, 300);
    let (correct, pred) = if strict_box_verify {
        let tail = python_tail(solution, 100);
        let pred = dapo_last_boxed(tail).and_then(|b| {
            b.strip_prefix("\\boxed{")
                .and_then(|x| x.strip_suffix('}'))
                .map(str::to_string)
        });
        (pred.as_deref() == Some(ground_truth), pred)
    } else {
        let extracted = MINERVA_ANSWER
            .captures_iter(solution)
            .last()
            .map(|c| c[1].to_string())
            .unwrap_or_else(|| "[INVALID]".into());
        let pred = normalize_final_answer(&extracted);
        (pred == normalize_final_answer(ground_truth), Some(pred))
    };
    RewardOutput::new(if correct { 1.0 } else { -1.0 })
        .with("acc", correct)
        .with("pred", pred)
}
