//! Countdown (TinyZero): the `<answer>` equation must use exactly the given numbers and equal
//! the target. Format score 0.1, score 1.0, as TinyZero's `countdown.py`.

use std::sync::LazyLock;

use regex::Regex;

use super::{RewardOutput, py_strip};

static ANSWER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"<answer>(.*?)</answer>").expect("static regex"));
static ALLOWED: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[\d+\-*/().\s]+$").expect("static regex"));
static INTS: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\d+").expect("static regex"));

/// The equation in the last `<answer>...</answer>` of the response's last line, stripped.
///
/// TinyZero decodes prompt + response, keeps the text after the first `Assistant:` (or
/// `<|im_start|>assistant`; without either it scores 0), then only its last line
/// (`split('\n')[-1]`): an answer followed by more text on a new line, or by a trailing
/// newline, is not found. We are given the response alone, so the marker is not required: the
/// text after it is used when it is there (a response that repeats it), the whole response
/// otherwise.
pub fn extract_solution(solution: &str) -> Option<String> {
    let s = if let Some((_, after)) = solution.split_once("Assistant:") {
        after
    } else if let Some((_, after)) = solution.split_once("<|im_start|>assistant") {
        after
    } else {
        solution
    };
    let last_line = s.rsplit('\n').next().unwrap_or(s);
    ANSWER
        .captures_iter(last_line)
        .last()
        .map(|c| py_strip(&c[1]).to_string())
}

/// Do the integers in `equation` use each available number exactly once?
pub fn validate_equation(equation: &str, numbers: &[i64]) -> bool {
    let mut used: Vec<i64> = Vec::new();
    for m in INTS.find_iter(equation) {
        match m.as_str().parse::<i64>() {
            Ok(v) => used.push(v),
            Err(_) => return false,
        }
    }
    let mut avail = numbers.to_vec();
    used.sort_unstable();
    avail.sort_unstable();
    used == avail
}

/// Evaluates `+ - * / ** //`, parentheses, unary signs and decimals as Python's `eval` would
/// (true division, float results); `None` for anything else or a division by zero.
pub fn evaluate_equation(equation: &str) -> Option<f64> {
    if !ALLOWED.is_match(equation) {
        return None;
    }
    let mut p = Parser {
        s: equation.as_bytes(),
        i: 0,
    };
    let v = p.expr()?;
    p.ws();
    (p.i == p.s.len() && v.is_finite()).then_some(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.i).copied()
    }
    fn eat(&mut self, tok: &str) -> bool {
        self.ws();
        if self.s[self.i..].starts_with(tok.as_bytes()) {
            self.i += tok.len();
            true
        } else {
            false
        }
    }
    fn expr(&mut self) -> Option<f64> {
        let mut v = self.term()?;
        loop {
            if self.eat("+") {
                v += self.term()?;
            } else if self.eat("-") {
                v -= self.term()?;
            } else {
                return Some(v);
            }
        }
    }
    fn term(&mut self) -> Option<f64> {
        let mut v = self.unary()?;
        loop {
            if self.s[self.i..].starts_with(b"**") {
                return Some(v);
            }
            if self.eat("//") {
                let d = self.unary()?;
                if d == 0.0 {
                    return None;
                }
                v = (v / d).floor();
            } else if self.peek() == Some(b'*') && !self.s[self.i..].starts_with(b"**") {
                self.i += 1;
                v *= self.unary()?;
            } else if self.eat("/") {
                let d = self.unary()?;
                if d == 0.0 {
                    return None;
                }
                v /= d;
            } else {
                return Some(v);
            }
        }
    }
    fn unary(&mut self) -> Option<f64> {
        if self.eat("-") {
            return Some(-self.unary()?);
        }
        if self.eat("+") {
            return self.unary();
        }
        self.power()
    }
    fn power(&mut self) -> Option<f64> {
        let base = self.atom()?;
        if self.eat("**") {
            let exp = self.unary()?;
            if base == 0.0 && exp < 0.0 {
                return None;
            }
            let v = base.powf(exp);
            return v.is_finite().then_some(v);
        }
        Some(base)
    }
    fn atom(&mut self) -> Option<f64> {
        if self.eat("(") {
            let v = self.expr()?;
            return self.eat(")").then_some(v);
        }
        self.ws();
        let start = self.i;
        while self.i < self.s.len() && (self.s[self.i].is_ascii_digit() || self.s[self.i] == b'.') {
            self.i += 1;
        }
        let lit = std::str::from_utf8(&self.s[start..self.i]).ok()?;
        // Python 3 rejects integer literals with leading zeros (`01`), and a bare `.`.
        let int_like = !lit.contains('.');
        if lit.is_empty()
            || lit == "."
            || (int_like && lit.len() > 1 && lit.starts_with('0') && lit.bytes().any(|b| b != b'0'))
        {
            return None;
        }
        lit.parse::<f64>().ok()
    }
}

/// TinyZero's `compute_score`: 0 without an answer, `format_score` when the equation uses the
/// wrong numbers or does not evaluate to the target, `score` when it does (within 1e-5).
pub fn compute_score(
    solution: &str,
    target: f64,
    numbers: &[i64],
    format_score: f64,
    score: f64,
) -> RewardOutput {
    let Some(eq) = extract_solution(solution) else {
        return RewardOutput::new(0.0)
            .with("acc", false)
            .with("pred", None::<String>);
    };
    let result = validate_equation(&eq, numbers)
        .then(|| evaluate_equation(&eq))
        .flatten();
    let ok = result.is_some_and(|r| (r - target).abs() < 1e-5);
    RewardOutput::new(if ok { score } else { format_score })
        .with("acc", ok)
        .with("pred", Some(eq))
        .with("value", result)
}
