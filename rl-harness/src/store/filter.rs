//! The `harness runs --filter` language: comparisons of config keys, final metrics and run
//! fields, joined by `and`, `or`, `not` and parentheses.
//!
//! ```text
//! expr    := and ('or' and)*
//! and     := unary ('and' unary)*
//! unary   := 'not' unary | '(' expr ')' | key op literal
//! op      := = | == | != | < | <= | > | >= | ~        (~ : the text contains)
//! literal := 'text' | "text" | number | true | false
//! ```
//! A key is a run field (`id`, `name`, `status`, `project`, `seed`, `sweep`), a config key path
//! (`algorithm.adv_estimator`), or a metric (`val/test_score`, its last value). A comparison
//! with a key the run lacks is false.

use anyhow::{Result, bail};
use serde_json::Value;

/// A parsed filter.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// Both.
    And(Box<Expr>, Box<Expr>),
    /// Either.
    Or(Box<Expr>, Box<Expr>),
    /// Negation.
    Not(Box<Expr>),
    /// `key op literal`.
    Cmp(String, Op, Value),
}

/// A comparison operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `=` or `==`.
    Eq,
    /// `!=`.
    Ne,
    /// `<`.
    Lt,
    /// `<=`.
    Le,
    /// `>`.
    Gt,
    /// `>=`.
    Ge,
    /// `~`: contains.
    Contains,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Num(f64),
    Op(Op),
    LParen,
    RParen,
}

fn lex(src: &str) -> Result<Vec<Tok>> {
    let chars: Vec<char> = src.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    while i < chars.len() {
        let c = chars[i];
        match c {
            ' ' | '\t' | '\n' => i += 1,
            '(' => {
                out.push(Tok::LParen);
                i += 1
            }
            ')' => {
                out.push(Tok::RParen);
                i += 1
            }
            '\'' | '"' => {
                let end = chars[i + 1..]
                    .iter()
                    .position(|&d| d == c)
                    .map(|p| p + i + 1);
                let Some(end) = end else {
                    bail!("filter: unterminated string starting at column {}", i + 1);
                };
                out.push(Tok::Str(chars[i + 1..end].iter().collect()));
                i = end + 1;
            }
            '=' | '!' | '<' | '>' | '~' => {
                let two: String = chars[i..(i + 2).min(chars.len())].iter().collect();
                let (op, len) = match two.as_str() {
                    "==" => (Op::Eq, 2),
                    "!=" => (Op::Ne, 2),
                    "<=" => (Op::Le, 2),
                    ">=" => (Op::Ge, 2),
                    _ => match c {
                        '=' => (Op::Eq, 1),
                        '<' => (Op::Lt, 1),
                        '>' => (Op::Gt, 1),
                        '~' => (Op::Contains, 1),
                        _ => bail!("filter: `!` must be followed by `=` (column {})", i + 1),
                    },
                };
                out.push(Tok::Op(op));
                i += len;
            }
            c if c.is_ascii_digit()
                || ((c == '-' || c == '.')
                    && i + 1 < chars.len()
                    && chars[i + 1].is_ascii_digit()) =>
            {
                let start = i;
                i += 1;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '.' | '-' | '+'))
                {
                    i += 1;
                }
                let text: String = chars[start..i].iter().collect();
                let n: f64 = text
                    .parse()
                    .map_err(|_| anyhow::anyhow!("filter: bad number `{text}`"))?;
                out.push(Tok::Num(n));
            }
            c if c.is_alphanumeric() || c == '_' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_alphanumeric()
                        || matches!(chars[i], '_' | '.' | '/' | '-' | '@' | ':'))
                {
                    i += 1;
                }
                out.push(Tok::Ident(chars[start..i].iter().collect()));
            }
            other => bail!("filter: unexpected `{other}` at column {}", i + 1),
        }
    }
    Ok(out)
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
}

impl Parser {
    fn peek_word(&self, w: &str) -> bool {
        matches!(self.toks.get(self.pos), Some(Tok::Ident(s)) if s.eq_ignore_ascii_case(w))
    }

    fn or(&mut self) -> Result<Expr> {
        let mut e = self.and()?;
        while self.peek_word("or") {
            self.pos += 1;
            e = Expr::Or(Box::new(e), Box::new(self.and()?));
        }
        Ok(e)
    }

    fn and(&mut self) -> Result<Expr> {
        let mut e = self.unary()?;
        while self.peek_word("and") {
            self.pos += 1;
            e = Expr::And(Box::new(e), Box::new(self.unary()?));
        }
        Ok(e)
    }

    fn unary(&mut self) -> Result<Expr> {
        if self.peek_word("not") {
            self.pos += 1;
            return Ok(Expr::Not(Box::new(self.unary()?)));
        }
        match self.toks.get(self.pos).cloned() {
            Some(Tok::LParen) => {
                self.pos += 1;
                let e = self.or()?;
                if self.toks.get(self.pos) != Some(&Tok::RParen) {
                    bail!("filter: missing `)`");
                }
                self.pos += 1;
                Ok(e)
            }
            Some(Tok::Ident(key)) => {
                self.pos += 1;
                let Some(Tok::Op(op)) = self.toks.get(self.pos).cloned() else {
                    bail!("filter: expected an operator (= != < <= > >= ~) after `{key}`");
                };
                self.pos += 1;
                let lit = match self.toks.get(self.pos).cloned() {
                    Some(Tok::Str(s)) => Value::String(s),
                    Some(Tok::Num(n)) => serde_json::json!(n),
                    Some(Tok::Ident(w)) if w == "true" || w == "false" => Value::Bool(w == "true"),
                    Some(Tok::Ident(w)) => {
                        bail!("filter: `{w}` after `{key}` is not a value; quote text as '{w}'")
                    }
                    _ => bail!("filter: expected a value after `{key}`"),
                };
                self.pos += 1;
                Ok(Expr::Cmp(key, op, lit))
            }
            Some(t) => bail!("filter: unexpected {t:?}"),
            None => bail!("filter: unexpected end of the expression"),
        }
    }
}

/// Parses a filter expression.
pub fn parse(src: &str) -> Result<Expr> {
    let mut p = Parser {
        toks: lex(src)?,
        pos: 0,
    };
    let e = p.or()?;
    if p.pos != p.toks.len() {
        bail!(
            "filter: unexpected {:?} after a complete expression",
            p.toks[p.pos]
        );
    }
    Ok(e)
}

impl Expr {
    /// Evaluates against `lookup(key)`.
    pub fn eval(&self, lookup: &dyn Fn(&str) -> Option<Value>) -> bool {
        match self {
            Expr::And(a, b) => a.eval(lookup) && b.eval(lookup),
            Expr::Or(a, b) => a.eval(lookup) || b.eval(lookup),
            Expr::Not(a) => !a.eval(lookup),
            Expr::Cmp(key, op, lit) => lookup(key).is_some_and(|v| compare(&v, *op, lit)),
        }
    }
}

impl Expr {
    /// Every `(key, literal)` compared, left to right.
    pub fn comparisons(&self) -> Vec<(&str, &Value)> {
        match self {
            Expr::And(a, b) | Expr::Or(a, b) => {
                let mut v = a.comparisons();
                v.extend(b.comparisons());
                v
            }
            Expr::Not(a) => a.comparisons(),
            Expr::Cmp(key, _, lit) => vec![(key.as_str(), lit)],
        }
    }
}

/// `trainer.stop_when`: a filter over one validation's metrics (`val/loss < 0.8`). Every key
/// is a validation metric (`val/...`) compared with a number.
#[derive(Debug, Clone, PartialEq)]
pub struct StopWhen {
    src: String,
    expr: Expr,
}

impl StopWhen {
    /// Parses and checks the condition.
    pub fn parse(src: &str) -> Result<StopWhen> {
        let expr = parse(src)?;
        for (key, lit) in expr.comparisons() {
            if !key.starts_with("val/") {
                bail!(
                    "`{key}` is not a validation metric: the condition is checked on the \
                     metrics of a validation, whose keys start with `val/`"
                );
            }
            if lit.as_f64().is_none() {
                bail!("`{key}` is compared with {lit}, which is not a number");
            }
        }
        Ok(StopWhen {
            src: src.to_string(),
            expr,
        })
    }

    /// Whether the validation metrics `m` satisfy the condition: `Some` with the compared
    /// values spelled out (`val/loss = 0.7731`) when they do. A key the validation did not log
    /// is an error naming it and the keys it did log, never a silent "not yet".
    pub fn met(&self, m: &std::collections::BTreeMap<String, f64>) -> Result<Option<String>> {
        let mut values = Vec::new();
        for (key, _) in self.expr.comparisons() {
            let Some(v) = m.get(key) else {
                bail!(
                    "config key `trainer.stop_when` ({}): the validation logged no `{key}`; it \
                     logged {}",
                    self.src,
                    m.keys()
                        .map(|k| format!("`{k}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            };
            values.push(format!("{key} = {v:.4}"));
        }
        let met = self.expr.eval(&|k| {
            m.get(k)
                .and_then(|v| serde_json::Number::from_f64(*v))
                .map(Value::Number)
        });
        Ok(met.then(|| format!("`{}` met: {}", self.src, values.join(", "))))
    }
}

fn as_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn compare(v: &Value, op: Op, lit: &Value) -> bool {
    if let (Some(a), Some(b)) = (v.as_f64(), lit.as_f64()) {
        return match op {
            Op::Eq => a == b,
            Op::Ne => a != b,
            Op::Lt => a < b,
            Op::Le => a <= b,
            Op::Gt => a > b,
            Op::Ge => a >= b,
            Op::Contains => as_text(v).contains(&as_text(lit)),
        };
    }
    let (a, b) = (as_text(v), as_text(lit));
    match op {
        Op::Eq => a == b,
        Op::Ne => a != b,
        Op::Lt => a < b,
        Op::Le => a <= b,
        Op::Gt => a > b,
        Op::Ge => a >= b,
        Op::Contains => a.contains(&b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_issues_example_parses_and_evaluates() {
        let e = parse("algorithm.adv_estimator = 'grpo' and val/test_score > 0.5").unwrap();
        let run = |est: &'static str, score: f64| {
            move |k: &str| match k {
                "algorithm.adv_estimator" => Some(json!(est)),
                "val/test_score" => Some(json!(score)),
                _ => None,
            }
        };
        assert!(e.eval(&run("grpo", 0.7)));
        assert!(!e.eval(&run("grpo", 0.3)));
        assert!(!e.eval(&run("gae", 0.7)));
    }

    #[test]
    fn precedence_not_and_or_and_parentheses() {
        let look = |k: &str| match k {
            "a" => Some(json!(1)),
            "b" => Some(json!("x")),
            _ => None,
        };
        assert!(parse("a = 2 or a = 1 and b = 'x'").unwrap().eval(&look));
        assert!(!parse("(a = 2 or a = 1) and b = 'y'").unwrap().eval(&look));
        assert!(parse("not a >= 2").unwrap().eval(&look));
        assert!(parse("b ~ 'x' and a != 3").unwrap().eval(&look));
        // Missing keys make a comparison false.
        assert!(!parse("missing = 1").unwrap().eval(&look));
        assert!(parse("not missing = 1").unwrap().eval(&look));
    }

    #[test]
    fn stop_when_is_checked_on_validation_metrics() {
        let stop = StopWhen::parse("val/loss < 0.8 or val/acc >= 0.5").unwrap();
        let m = |loss: f64, acc: f64| {
            std::collections::BTreeMap::from([
                ("val/loss".to_string(), loss),
                ("val/acc".to_string(), acc),
            ])
        };
        assert_eq!(stop.met(&m(0.9, 0.2)).unwrap(), None);
        let said = stop.met(&m(0.79, 0.2)).unwrap().unwrap();
        assert!(said.contains("val/loss = 0.7900"), "{said}");
        assert!(stop.met(&m(0.9, 0.5)).unwrap().is_some());
        // a metric the validation does not log is an error naming it and what was logged
        let only_loss = std::collections::BTreeMap::from([("val/loss".to_string(), 0.1)]);
        let err = stop.met(&only_loss).unwrap_err().to_string();
        assert!(
            err.contains("`val/acc`") && err.contains("`val/loss`"),
            "{err}"
        );
        // keys must be validation metrics, compared with numbers
        let err = StopWhen::parse("actor/loss < 1").unwrap_err().to_string();
        assert!(err.contains("`actor/loss`"), "{err}");
        let err = StopWhen::parse("val/loss < 'x'").unwrap_err().to_string();
        assert!(err.contains("not a number"), "{err}");
        assert!(StopWhen::parse("val/loss <").is_err());
    }

    #[test]
    fn errors_name_the_problem() {
        assert!(
            parse("a = ")
                .unwrap_err()
                .to_string()
                .contains("expected a value")
        );
        assert!(
            parse("a 3")
                .unwrap_err()
                .to_string()
                .contains("expected an operator")
        );
        assert!(
            parse("(a = 1")
                .unwrap_err()
                .to_string()
                .contains("missing `)`")
        );
        assert!(parse("a = grpo").unwrap_err().to_string().contains("quote"));
        assert!(
            parse("a = 'x")
                .unwrap_err()
                .to_string()
                .contains("unterminated")
        );
    }
}
