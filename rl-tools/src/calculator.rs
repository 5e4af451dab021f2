//! The calculator tool: `+ - * /` and parentheses over integers and decimals, computed exactly
//! (rationals over `i128`), so `0.1+0.2` is `0.3`.

use rl_core::{Observation, Tool};

/// `<calculator>2+3*4</calculator>` → `\n<result>14</result>\n`.
///
/// Results print as integers when whole, as exact decimals when they terminate (`7/4` →
/// `1.75`), else rounded to 6 decimals (`1/3` → `0.333333`). A parse error, a division by zero
/// or an overflow gives a failed observation naming the problem
/// (`\n<result>error: division by zero</result>\n`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CalculatorTool;

impl Tool for CalculatorTool {
    fn name(&self) -> &str {
        "calculator"
    }

    fn call(&self, arguments: &[String]) -> Vec<Observation> {
        arguments
            .iter()
            .map(|a| match evaluate(a) {
                Ok(v) => Observation::ok(format!("\n<result>{v}</result>\n")),
                Err(e) => Observation::failed(format!("\n<result>error: {e}</result>\n")),
            })
            .collect()
    }
}

/// Evaluates an expression and formats the result as [`CalculatorTool`] does; the error says
/// what is wrong and where (`unexpected `x` at 3`, `division by zero`).
pub fn evaluate(expr: &str) -> Result<String, String> {
    const MAX_LEN: usize = 1000;
    if expr.chars().count() > MAX_LEN {
        return Err(format!("expression longer than {MAX_LEN} characters"));
    }
    let chars: Vec<char> = expr.chars().collect();
    let mut p = Parser { chars, pos: 0 };
    p.skip_ws();
    if p.pos == p.chars.len() {
        return Err("empty expression".into());
    }
    let v = p.expr(0)?;
    p.skip_ws();
    if let Some(&c) = p.chars.get(p.pos) {
        return Err(format!("unexpected `{c}` at {}", p.pos + 1));
    }
    Ok(v.format())
}

/// An exact fraction `num / den` with `den > 0`, in lowest terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ratio {
    num: i128,
    den: i128,
}

const OVERFLOW: &str = "number too large";

/// The greatest common divisor, on magnitudes (so `i128::MIN` cannot overflow); 1 (no
/// reduction, the value stays exact) when it does not fit an `i128`.
fn gcd(a: i128, b: i128) -> i128 {
    let (mut a, mut b) = (a.unsigned_abs(), b.unsigned_abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    i128::try_from(a).unwrap_or(1)
}

impl Ratio {
    fn new(num: i128, den: i128) -> Result<Ratio, String> {
        if den == 0 {
            return Err("division by zero".into());
        }
        let g = gcd(num, den).max(1);
        let (mut num, mut den) = (num / g, den / g);
        if den < 0 {
            num = num.checked_neg().ok_or(OVERFLOW)?;
            den = den.checked_neg().ok_or(OVERFLOW)?;
        }
        Ok(Ratio { num, den })
    }

    fn add(self, o: Ratio) -> Result<Ratio, String> {
        let num = self
            .num
            .checked_mul(o.den)
            .and_then(|a| o.num.checked_mul(self.den).and_then(|b| a.checked_add(b)))
            .ok_or(OVERFLOW)?;
        let den = self.den.checked_mul(o.den).ok_or(OVERFLOW)?;
        Ratio::new(num, den)
    }

    fn neg(self) -> Result<Ratio, String> {
        Ok(Ratio {
            num: self.num.checked_neg().ok_or(OVERFLOW)?,
            den: self.den,
        })
    }

    fn mul(self, o: Ratio) -> Result<Ratio, String> {
        // cross-reduce first to keep the numbers small
        let g1 = gcd(self.num, o.den).max(1);
        let g2 = gcd(o.num, self.den).max(1);
        let num = (self.num / g1).checked_mul(o.num / g2).ok_or(OVERFLOW)?;
        let den = (self.den / g2).checked_mul(o.den / g1).ok_or(OVERFLOW)?;
        Ratio::new(num, den)
    }

    fn div(self, o: Ratio) -> Result<Ratio, String> {
        if o.num == 0 {
            return Err("division by zero".into());
        }
        self.mul(Ratio::new(o.den, o.num)?)
    }

    /// An integer, an exact terminating decimal, or 6 rounded decimals.
    fn format(self) -> String {
        if self.den == 1 {
            return self.num.to_string();
        }
        let (mut twos, mut fives, mut d) = (0u32, 0u32, self.den);
        while d % 2 == 0 {
            d /= 2;
            twos += 1;
        }
        while d % 5 == 0 {
            d /= 5;
            fives += 1;
        }
        let exact = d == 1;
        let places = if exact { twos.max(fives).min(30) } else { 6 };
        let scale = 10i128.pow(places);
        let sign = if self.num < 0 { "-" } else { "" };
        let abs = self.num.unsigned_abs();
        let den = self.den.unsigned_abs();
        let scale = scale.unsigned_abs();
        // round half away from zero: (abs * scale + den / 2) / den, split to avoid overflow
        let whole = abs / den;
        let rem = abs % den;
        let frac = match rem.checked_mul(scale) {
            Some(r) => (r + den / 2) / den,
            None => ((rem as f64 / den as f64) * scale as f64).round() as u128,
        };
        let (whole, frac) = if frac >= scale {
            (whole + 1, frac - scale)
        } else {
            (whole, frac)
        };
        let mut digits = format!("{frac:0width$}", width = places as usize);
        while digits.ends_with('0') {
            digits.pop();
        }
        if digits.is_empty() {
            if whole == 0 {
                return "0".into();
            }
            return format!("{sign}{whole}");
        }
        format!("{sign}{whole}.{digits}")
    }
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
}

const MAX_DEPTH: usize = 64;

impl Parser {
    fn skip_ws(&mut self) {
        while self.chars.get(self.pos).is_some_and(|c| c.is_whitespace()) {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.chars.get(self.pos).copied()
    }

    fn expr(&mut self, depth: usize) -> Result<Ratio, String> {
        let mut v = self.term(depth)?;
        while let Some(op @ ('+' | '-')) = self.peek() {
            self.pos += 1;
            let r = self.term(depth)?;
            v = if op == '+' {
                v.add(r)?
            } else {
                v.add(r.neg()?)?
            };
        }
        Ok(v)
    }

    fn term(&mut self, depth: usize) -> Result<Ratio, String> {
        let mut v = self.factor(depth)?;
        while let Some(op @ ('*' | '/' | '×' | '÷')) = self.peek() {
            self.pos += 1;
            let r = self.factor(depth)?;
            v = if matches!(op, '/' | '÷') {
                v.div(r)?
            } else {
                v.mul(r)?
            };
        }
        Ok(v)
    }

    fn factor(&mut self, depth: usize) -> Result<Ratio, String> {
        if depth > MAX_DEPTH {
            return Err(format!("nested deeper than {MAX_DEPTH}"));
        }
        match self.peek() {
            None => Err("expression ends early".into()),
            Some('-') => {
                self.pos += 1;
                self.factor(depth + 1)?.neg()
            }
            Some('+') => {
                self.pos += 1;
                self.factor(depth + 1)
            }
            Some('(') => {
                let open = self.pos;
                self.pos += 1;
                let v = self.expr(depth + 1)?;
                if self.peek() != Some(')') {
                    return Err(format!("unclosed `(` at {}", open + 1));
                }
                self.pos += 1;
                Ok(v)
            }
            Some(c) if c.is_ascii_digit() || c == '.' => self.number(),
            Some(c) => Err(format!("unexpected `{c}` at {}", self.pos + 1)),
        }
    }

    fn number(&mut self) -> Result<Ratio, String> {
        let start = self.pos;
        let (mut num, mut den, mut dot) = (0i128, 1i128, false);
        let mut digits = 0;
        while let Some(&c) = self.chars.get(self.pos) {
            if c == '.' && !dot {
                dot = true;
            } else if let Some(d) = c.to_digit(10) {
                digits += 1;
                num = num
                    .checked_mul(10)
                    .and_then(|n| n.checked_add(i128::from(d)))
                    .ok_or(OVERFLOW)?;
                if dot {
                    den = den.checked_mul(10).ok_or(OVERFLOW)?;
                }
            } else {
                break;
            }
            self.pos += 1;
        }
        if digits == 0 {
            return Err(format!("unexpected `.` at {}", start + 1));
        }
        Ratio::new(num, den)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluates_precedence_parentheses_decimals_and_signs() {
        let cases = [
            ("2+3*4", "14"),
            ("(2+3)*4", "20"),
            (" 10 / 4 ", "2.5"),
            ("7/4", "1.75"),
            ("0.1+0.2", "0.3"),
            ("1/3", "0.333333"),
            ("2/3", "0.666667"),
            ("-3*-2", "6"),
            ("-(1.5+1.5)", "-3"),
            ("1-10", "-9"),
            ("-1/8", "-0.125"),
            (".5*4", "2"),
            ("8-2-1", "5"),
            ("16/4/2", "2"),
            ("3×4÷8", "1.5"),
            ("99999999999*99999999999", "9999999999800000000001"),
            // an exact binary fraction longer than 30 places is rounded to 30, not shifted
            ("1/1099511627776", "0.000000000000909494701772928238"),
        ];
        for (expr, want) in cases {
            assert_eq!(evaluate(expr).as_deref(), Ok(want), "{expr}");
        }
        // i128::MIN reached by the model's own arithmetic is a result or an error, not a panic
        let min = "-85070591730234615865843651857942052864-85070591730234615865843651857942052864";
        assert_eq!(
            evaluate(min).as_deref(),
            Ok("-170141183460469231731687303715884105728")
        );
    }

    #[test]
    fn errors_name_the_problem_and_where() {
        let cases = [
            ("1/0", "division by zero"),
            ("1/(2-2)", "division by zero"),
            ("", "empty expression"),
            ("  ", "empty expression"),
            ("2+", "expression ends early"),
            ("2+a", "unexpected `a` at 3"),
            ("(1+2", "unclosed `(` at 1"),
            ("1+2)", "unexpected `)` at 4"),
            ("1..2", "unexpected `.` at 3"),
        ];
        for (expr, want) in cases {
            assert_eq!(evaluate(expr), Err(want.to_string()), "{expr}");
        }
        let deep = format!("{}1{}", "(".repeat(100), ")".repeat(100));
        assert!(evaluate(&deep).unwrap_err().contains("nested deeper"));
        let big = format!("{}*{}", "9".repeat(30), "9".repeat(30));
        assert_eq!(evaluate(&big), Err("number too large".into()));
    }

    #[test]
    fn the_tool_wraps_results_and_marks_failures_invalid() {
        let out = CalculatorTool.call(&["2+3*4".into(), "5/0".into()]);
        assert_eq!(out[0], Observation::ok("\n<result>14</result>\n"));
        assert_eq!(
            out[1],
            Observation::failed("\n<result>error: division by zero</result>\n")
        );
        assert_eq!(CalculatorTool.name(), "calculator");
    }
}
