//! Arithmetic: `a op b op c` with configurable digits and operators; the answer is an integer.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{GeneratedFiles, SplitSizes, TaskRng, generate_splits};
use crate::error::{Error, Result};
use crate::parquet_io::RlRecord;
use crate::reward::countdown::evaluate_equation;
use crate::tokenizer::Message;

/// Options for [`generate_arithmetic`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArithmeticConfig {
    /// Most digits per operand (1..=9).
    pub digits: u32,
    /// Operators to draw from, any of `+ - * /` (`/` only where the division is exact).
    pub operators: Vec<char>,
    /// Operands per expression (2..=6).
    pub operands: usize,
}

impl Default for ArithmeticConfig {
    fn default() -> Self {
        Self {
            digits: 2,
            operators: vec!['+', '-', '*'],
            operands: 2,
        }
    }
}

/// The instruction appended to each expression.
const INSTRUCTION: &str = "Give the final answer as a number on the last line.";

/// Writes `dir/{train,test}.parquet` of arithmetic problems (`data_source = "arithmetic"`,
/// ground truth the integer result as a string).
pub fn generate_arithmetic(
    dir: &Path,
    cfg: &ArithmeticConfig,
    sizes: SplitSizes,
    seed: u64,
) -> Result<GeneratedFiles> {
    let bad = |key: &str, message: &str| {
        Err(Error::Config {
            key: format!("arithmetic.{key}"),
            message: message.into(),
        })
    };
    if !(1..=9).contains(&cfg.digits) {
        return bad("digits", "must be in 1..=9");
    }
    if !(2..=6).contains(&cfg.operands) {
        return bad("operands", "must be in 2..=6");
    }
    if cfg.operators.is_empty() || cfg.operators.iter().any(|c| !"+-*/".contains(*c)) {
        return bad("operators", "must be a non-empty list of + - * /");
    }
    let max = 10i64.pow(cfg.digits) - 1;
    generate_splits(
        dir,
        sizes,
        seed,
        "arithmetic",
        |rng: &mut TaskRng, split, index| {
            let mut expr = rng.range(0, max).to_string();
            for _ in 1..cfg.operands {
                let op = *rng.pick(&cfg.operators);
                let operand = if op == '/' {
                    rng.range(1, max)
                } else {
                    rng.range(0, max)
                };
                expr = format!("{expr} {op} {operand}");
            }
            let value = evaluate_equation(&expr)?;
            // Integer answers only (exact divisions).
            if value.fract() != 0.0 || value.abs() > 1e15 {
                return None;
            }
            let answer = (value as i64).to_string();
            let mut extra = serde_json::Map::new();
            extra.insert("split".into(), split.into());
            extra.insert("index".into(), index.into());
            extra.insert("expression".into(), expr.clone().into());
            Some(RlRecord {
                data_source: "arithmetic".into(),
                prompt: vec![Message::user(format!("What is {expr}? {INSTRUCTION}"))],
                ability: "math".into(),
                style: "rule".into(),
                ground_truth: Value::String(answer),
                extra_info: extra,
            })
        },
    )
}
