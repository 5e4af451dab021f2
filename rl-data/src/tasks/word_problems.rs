//! Short multi-step word problems with answers in GSM8K's format (`<<a*b=c>>` steps, `#### N`).

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{GeneratedFiles, SplitSizes, TaskRng, generate_splits};
use crate::error::{Error, Result};
use crate::parquet_io::RlRecord;
use crate::tasks::GSM8K_INSTRUCTION;
use crate::tokenizer::Message;

/// Options for [`generate_word_problems`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WordProblemsConfig {
    /// Largest quantity in a problem statement (at least 5).
    pub max_value: i64,
}

impl Default for WordProblemsConfig {
    fn default() -> Self {
        Self { max_value: 50 }
    }
}

const NAMES: [&str; 10] = [
    "Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark",
];
const ITEMS: [&str; 8] = [
    "apples", "clips", "stickers", "marbles", "books", "cookies", "pencils", "shells",
];

/// One problem: (question, worked answer ending in `#### N`, N).
fn make_problem(rng: &mut TaskRng, max: i64) -> (String, String, i64) {
    let name = *rng.pick(&NAMES);
    let item = *rng.pick(&ITEMS);
    match rng.index(4) {
        0 => {
            let (a, b, c) = (
                rng.range(1, max),
                rng.range(2, 9),
                rng.range(2, max.min(12)),
            );
            let bc = b * c;
            let total = a + bc;
            (
                format!(
                    "{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack. How many {item} does {name} have now?"
                ),
                format!(
                    "The packs hold {b}*{c} = <<{b}*{c}={bc}>>{bc} {item}.\n{name} now has {a}+{bc} = <<{a}+{bc}={total}>>{total} {item}.\n#### {total}"
                ),
                total,
            )
        }
        1 => {
            let (a, b) = (rng.range(2, max), rng.range(2, 9));
            let total = a * b;
            let d = rng.range(1, total);
            let left = total - d;
            (
                format!(
                    "{name} collects {a} {item} every day for {b} days, then gives away {d} of them. How many {item} are left?"
                ),
                format!(
                    "{name} collects {a}*{b} = <<{a}*{b}={total}>>{total} {item}.\nAfter giving away {d}, {total}-{d} = <<{total}-{d}={left}>>{left} are left.\n#### {left}"
                ),
                left,
            )
        }
        2 => {
            let (per, k) = (rng.range(2, 9), rng.range(2, 9));
            let a = per * k;
            let extra = rng.range(1, max);
            let total = k + extra;
            (
                format!(
                    "{name} shares {a} {item} equally among friends so that each friend gets {per}. Then {extra} more friends arrive. How many friends are there now?"
                ),
                format!(
                    "There were {a}/{per} = <<{a}/{per}={k}>>{k} friends.\nNow there are {k}+{extra} = <<{k}+{extra}={total}>>{total} friends.\n#### {total}"
                ),
                total,
            )
        }
        _ => {
            let (a, price, paid_extra) = (rng.range(2, 12), rng.range(1, 9), rng.range(1, max));
            let cost = a * price;
            let paid = cost + paid_extra;
            let change = paid - cost;
            (
                format!(
                    "{name} buys {a} {item} at ${price} each and pays with ${paid}. How much change does {name} get, in dollars?"
                ),
                format!(
                    "The {item} cost {a}*{price} = $<<{a}*{price}={cost}>>{cost}.\nThe change is {paid}-{cost} = $<<{paid}-{cost}={change}>>{change}.\n#### {change}"
                ),
                change,
            )
        }
    }
}

/// Writes `dir/{train,test}.parquet` of two-step word problems (`data_source =
/// "word_problems"`, scored like GSM8K; the worked answer is in `extra_info.answer`).
pub fn generate_word_problems(
    dir: &Path,
    cfg: &WordProblemsConfig,
    sizes: SplitSizes,
    seed: u64,
) -> Result<GeneratedFiles> {
    if cfg.max_value < 5 {
        return Err(Error::Config {
            key: "word_problems.max_value".into(),
            message: "must be at least 5".into(),
        });
    }
    generate_splits(
        dir,
        sizes,
        seed,
        "word_problems",
        |rng: &mut TaskRng, split, index| {
            let (question, answer, n) = make_problem(rng, cfg.max_value);
            let mut extra = serde_json::Map::new();
            extra.insert("split".into(), split.into());
            extra.insert("index".into(), index.into());
            extra.insert("answer".into(), answer.into());
            extra.insert("question".into(), question.clone().into());
            Some(RlRecord {
                data_source: "word_problems".into(),
                prompt: vec![Message::user(format!("{question} {GSM8K_INSTRUCTION}"))],
                ability: "math".into(),
                style: "rule".into(),
                ground_truth: Value::String(n.to_string()),
                extra_info: extra,
            })
        },
    )
}
