//! Countdown (TinyZero): reach a target with each given number used once and `+ - * /`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{GeneratedFiles, SplitSizes, TaskRng, generate_splits};
use crate::error::{Error, Result};
use crate::parquet_io::RlRecord;
use crate::reward::countdown::evaluate_equation;
use crate::tokenizer::Message;

/// Options for [`generate_countdown`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CountdownConfig {
    /// Fewest numbers per problem (TinyZero: 3).
    pub min_numbers: usize,
    /// Most numbers per problem (TinyZero: 4).
    pub max_numbers: usize,
    /// Numbers are drawn from `1..=max_number` (TinyZero: 99).
    pub max_number: i64,
    /// Targets lie in `1..=max_target` (TinyZero: 100).
    pub max_target: i64,
}

impl Default for CountdownConfig {
    fn default() -> Self {
        Self {
            min_numbers: 3,
            max_numbers: 4,
            max_number: 99,
            max_target: 100,
        }
    }
}

/// TinyZero's chat prompt for a countdown problem.
pub fn countdown_prompt(numbers: &[i64], target: i64) -> String {
    let nums = numbers
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "Using the numbers [{nums}], create an equation that equals {target}. You can use basic \
         arithmetic operations (+, -, *, /) and each number can only be used once. Show your work \
         in <think> </think> tags. And return the final answer in <answer> </answer> tags, for \
         example <answer> (1 + 2) / 3 </answer>."
    )
}

/// Writes `dir/{train,test}.parquet` of countdown problems (`data_source = "countdown"`, ground
/// truth `{target, numbers}`). Every problem is solvable: the target is the value of a random
/// expression over the numbers, kept in `extra_info.solution`.
pub fn generate_countdown(
    dir: &Path,
    cfg: &CountdownConfig,
    sizes: SplitSizes,
    seed: u64,
) -> Result<GeneratedFiles> {
    if cfg.min_numbers < 2 || cfg.max_numbers < cfg.min_numbers || cfg.max_numbers > 6 {
        return Err(Error::Config {
            key: "countdown.min_numbers".into(),
            message: "need 2 <= min_numbers <= max_numbers <= 6".into(),
        });
    }
    if cfg.max_number < 1 || cfg.max_target < 1 {
        return Err(Error::Config {
            key: "countdown.max_number".into(),
            message: "max_number and max_target must be at least 1".into(),
        });
    }
    generate_splits(
        dir,
        sizes,
        seed,
        "countdown",
        |rng: &mut TaskRng, split, index| {
            let n = rng.range(cfg.min_numbers as i64, cfg.max_numbers as i64) as usize;
            let numbers: Vec<i64> = (0..n).map(|_| rng.range(1, cfg.max_number)).collect();
            // Combine the numbers in a random order with random operators, bracketing as we go.
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                let j = rng.index(i + 1);
                order.swap(i, j);
            }
            let mut expr = numbers[order[0]].to_string();
            for &k in &order[1..] {
                let op = *rng.pick(&['+', '-', '*', '/']);
                expr = if rng.index(2) == 0 {
                    format!("({expr}) {op} {}", numbers[k])
                } else {
                    format!("{} {op} ({expr})", numbers[k])
                };
            }
            let value = evaluate_equation(&expr)?;
            if value.fract() != 0.0 || value < 1.0 || value > cfg.max_target as f64 {
                return None;
            }
            let target = value as i64;
            let mut extra = serde_json::Map::new();
            extra.insert("split".into(), split.into());
            extra.insert("index".into(), index.into());
            extra.insert("solution".into(), expr.into());
            Some(RlRecord {
                data_source: "countdown".into(),
                prompt: vec![Message::user(countdown_prompt(&numbers, target))],
                ability: "math".into(),
                style: "rule".into(),
                ground_truth: json!({"target": target, "numbers": numbers}),
                extra_info: extra,
            })
        },
    )
}
