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
    /// Problem kinds (`0..WORD_PROBLEM_KINDS`, each a two-step problem of its own shape) kept
    /// for the test split: training never sees them and the test split has only them, so the
    /// test score measures problems of a shape the policy never trained on.
    pub test_kinds: Vec<usize>,
    /// The phrasing (`0..WORD_PROBLEM_PHRASINGS`) of every kind kept for the test split:
    /// training problems are worded in the others only, so a test problem is of a kind seen in
    /// training but in words never seen there (as GSM8K's test problems are).
    pub test_phrasing: Option<usize>,
}

impl Default for WordProblemsConfig {
    fn default() -> Self {
        Self {
            max_value: 50,
            test_kinds: Vec::new(),
            test_phrasing: None,
        }
    }
}

/// How many kinds of problem the generator has (each a two-step problem of its own shape).
pub const WORD_PROBLEM_KINDS: usize = 8;
/// How many wordings each kind of problem has.
pub const WORD_PROBLEM_PHRASINGS: usize = 3;

const NAMES: [&str; 10] = [
    "Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark",
];
const ITEMS: [&str; 8] = [
    "apples", "clips", "stickers", "marbles", "books", "cookies", "pencils", "shells",
];

/// One problem: its question in each phrasing, the worked answer ending in `#### N`, and N.
struct Problem {
    phrasings: [String; WORD_PROBLEM_PHRASINGS],
    answer: String,
    value: i64,
}

/// A problem of kind `kind` with fresh names and numbers.
fn make_problem(rng: &mut TaskRng, kind: usize, max: i64) -> Problem {
    let name = *rng.pick(&NAMES);
    let item = *rng.pick(&ITEMS);
    match kind {
        0 => {
            let (a, b, c) = (
                rng.range(1, max),
                rng.range(2, 9),
                rng.range(2, max.min(12)),
            );
            let bc = b * c;
            let total = a + bc;
            Problem {
                phrasings: [
                    format!(
                        "{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack. How many {item} does {name} have now?"
                    ),
                    format!(
                        "There are {a} {item} in {name}'s bag. {name} adds {b} packs of {item}, and every pack holds {c}. How many {item} are in the bag now?"
                    ),
                    format!(
                        "{name} already owns {a} {item} and then gets {b} more packs of {c} {item} each. What is the total number of {item} {name} owns?"
                    ),
                ],
                answer: format!(
                    "The packs hold {b}*{c} = <<{b}*{c}={bc}>>{bc} {item}.\n{name} now has {a}+{bc} = <<{a}+{bc}={total}>>{total} {item}.\n#### {total}"
                ),
                value: total,
            }
        }
        1 => {
            let (a, b) = (rng.range(2, max), rng.range(2, 9));
            let total = a * b;
            let d = rng.range(1, total);
            let left = total - d;
            Problem {
                phrasings: [
                    format!(
                        "{name} collects {a} {item} every day for {b} days, then gives away {d} of them. How many {item} are left?"
                    ),
                    format!(
                        "For {b} days in a row, {name} picks up {a} {item} a day. Afterwards {name} hands out {d} {item}. How many {item} does {name} still have?"
                    ),
                    format!(
                        "Each day {name} gathers {a} {item}. After {b} days, {name} gives {d} {item} to friends. How many {item} remain with {name}?"
                    ),
                ],
                answer: format!(
                    "{name} collects {a}*{b} = <<{a}*{b}={total}>>{total} {item}.\nAfter giving away {d}, {total}-{d} = <<{total}-{d}={left}>>{left} are left.\n#### {left}"
                ),
                value: left,
            }
        }
        2 => {
            let (per, k) = (rng.range(2, 9), rng.range(2, 9));
            let a = per * k;
            let extra = rng.range(1, max);
            let total = k + extra;
            Problem {
                phrasings: [
                    format!(
                        "{name} shares {a} {item} equally among friends so that each friend gets {per}. Then {extra} more friends arrive. How many friends are there now?"
                    ),
                    format!(
                        "{name} hands out {a} {item}, {per} to each friend, until none are left. Later {extra} other friends join them. How many friends are there in all?"
                    ),
                    format!(
                        "Some friends split {a} {item} from {name} so that everyone gets {per}. If {extra} more friends come along, how many friends are there altogether?"
                    ),
                ],
                answer: format!(
                    "There were {a}/{per} = <<{a}/{per}={k}>>{k} friends.\nNow there are {k}+{extra} = <<{k}+{extra}={total}>>{total} friends.\n#### {total}"
                ),
                value: total,
            }
        }
        3 => {
            let (a, price, paid_extra) = (rng.range(2, 12), rng.range(1, 9), rng.range(1, max));
            let cost = a * price;
            let paid = cost + paid_extra;
            let change = paid - cost;
            Problem {
                phrasings: [
                    format!(
                        "{name} buys {a} {item} at ${price} each and pays with ${paid}. How much change does {name} get, in dollars?"
                    ),
                    format!(
                        "At the store, {item} cost ${price} apiece. {name} takes {a} of them and hands the cashier ${paid}. How many dollars of change should {name} receive?"
                    ),
                    format!(
                        "{name} pays ${paid} for {a} {item} that are ${price} each. How many dollars does {name} get back?"
                    ),
                ],
                answer: format!(
                    "The {item} cost {a}*{price} = $<<{a}*{price}={cost}>>{cost}.\nThe change is {paid}-{cost} = $<<{paid}-{cost}={change}>>{change}.\n#### {change}"
                ),
                value: change,
            }
        }
        4 => {
            let (per, k) = (rng.range(2, 9), rng.range(3, 12));
            let a = per * k;
            let given = rng.range(1, k - 1);
            let kept = k - given;
            Problem {
                phrasings: [
                    format!(
                        "{name} puts {a} {item} into bags of {per}. {name} gives {given} of the bags to a friend. How many bags does {name} keep?"
                    ),
                    format!(
                        "{name} packs {a} {item} so that each bag holds {per} of them, then gives away {given} bags. How many bags are left for {name}?"
                    ),
                    format!(
                        "{name} sorts {a} {item} into bags with {per} in every bag. If {given} bags go to a friend, how many bags does {name} have left?"
                    ),
                ],
                answer: format!(
                    "{name} fills {a}/{per} = <<{a}/{per}={k}>>{k} bags.\n{name} keeps {k}-{given} = <<{k}-{given}={kept}>>{kept} bags.\n#### {kept}"
                ),
                value: kept,
            }
        }
        5 => {
            let friend = *rng.pick(&NAMES);
            let friend = if friend == name { "a friend" } else { friend };
            let (a, more) = (rng.range(1, max), rng.range(1, max));
            let b = a + more;
            let total = a + b;
            Problem {
                phrasings: [
                    format!(
                        "{name} has {a} {item}. {friend} has {more} more {item} than {name}. How many {item} do they have together?"
                    ),
                    format!(
                        "{friend} owns {more} {item} more than {name}, who owns {a}. What is the total number of {item} the two of them own?"
                    ),
                    format!(
                        "{name} counts {a} {item}, and {friend} counts {more} more than that. How many {item} do {name} and {friend} have in all?"
                    ),
                ],
                answer: format!(
                    "{friend} has {a}+{more} = <<{a}+{more}={b}>>{b} {item}.\nTogether they have {a}+{b} = <<{a}+{b}={total}>>{total} {item}.\n#### {total}"
                ),
                value: total,
            }
        }
        6 => {
            let (a, b, weeks) = (rng.range(2, 12), rng.range(2, 9), rng.range(2, 9));
            let per_week = a * b;
            let total = per_week * weeks;
            Problem {
                phrasings: [
                    format!(
                        "A box holds {a} {item}. {name} buys {b} boxes every week for {weeks} weeks. How many {item} does {name} buy?"
                    ),
                    format!(
                        "{name} buys {b} boxes of {item} each week, and every box has {a} {item} in it. How many {item} does {name} buy in {weeks} weeks?"
                    ),
                    format!(
                        "For {weeks} weeks, {name} gets {b} boxes a week. Each box contains {a} {item}. How many {item} does {name} get altogether?"
                    ),
                ],
                answer: format!(
                    "Each week {name} buys {a}*{b} = <<{a}*{b}={per_week}>>{per_week} {item}.\nIn {weeks} weeks that is {per_week}*{weeks} = <<{per_week}*{weeks}={total}>>{total} {item}.\n#### {total}"
                ),
                value: total,
            }
        }
        _ => {
            let (k, each, d) = (rng.range(2, 9), rng.range(2, 12), rng.range(1, max));
            let rest = k * each;
            let a = rest + d;
            Problem {
                phrasings: [
                    format!(
                        "{name} has {a} {item}, keeps {d} of them and shares the rest equally among {k} friends. How many {item} does each friend get?"
                    ),
                    format!(
                        "Out of {a} {item}, {name} saves {d} and splits the others evenly between {k} friends. How many {item} does every friend receive?"
                    ),
                    format!(
                        "{name} starts with {a} {item}. After setting aside {d}, {name} divides what is left equally among {k} friends. How many {item} does each friend get?"
                    ),
                ],
                answer: format!(
                    "{name} shares {a}-{d} = <<{a}-{d}={rest}>>{rest} {item}.\nEach friend gets {rest}/{k} = <<{rest}/{k}={each}>>{each} {item}.\n#### {each}"
                ),
                value: each,
            }
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
    let kinds = split_held_out(
        &cfg.test_kinds,
        WORD_PROBLEM_KINDS,
        "word_problems.test_kinds",
        "kind",
    )?;
    let phrasings = split_held_out(
        &cfg.test_phrasing.into_iter().collect::<Vec<_>>(),
        WORD_PROBLEM_PHRASINGS,
        "word_problems.test_phrasing",
        "phrasing",
    )?;
    generate_splits(
        dir,
        sizes,
        seed,
        "word_problems",
        |rng: &mut TaskRng, split, index| {
            let kind = *rng.pick(side(&kinds, split));
            let phrasing = *rng.pick(side(&phrasings, split));
            let Problem {
                mut phrasings,
                answer,
                value: n,
            } = make_problem(rng, kind, cfg.max_value);
            let question = std::mem::take(&mut phrasings[phrasing]);
            let mut extra = serde_json::Map::new();
            extra.insert("split".into(), split.into());
            extra.insert("index".into(), index.into());
            extra.insert("kind".into(), kind.into());
            extra.insert("phrasing".into(), phrasing.into());
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

/// The values `split` draws from, of a [`split_held_out`] pair.
fn side<'a>((train, test): &'a (Vec<usize>, Vec<usize>), split: &str) -> &'a [usize] {
    if split == "test" { test } else { train }
}

/// The values (`0..count`) each split draws from: `test` alone for the test split and the
/// others for training, or every value for both when `test` is empty.
fn split_held_out(
    test: &[usize],
    count: usize,
    key: &str,
    what: &str,
) -> Result<(Vec<usize>, Vec<usize>)> {
    let all: Vec<usize> = (0..count).collect();
    if test.is_empty() {
        return Ok((all.clone(), all));
    }
    let bad = |message: String| Error::Config {
        key: key.into(),
        message,
    };
    if let Some(t) = test.iter().find(|&&t| t >= count) {
        return Err(bad(format!(
            "{what} {t} does not exist (there are {count}: 0 to {})",
            count - 1
        )));
    }
    let train: Vec<usize> = all.into_iter().filter(|t| !test.contains(t)).collect();
    if train.is_empty() {
        return Err(bad(format!(
            "{test:?} holds out every {what}, leaving none to train on"
        )));
    }
    let mut test = test.to_vec();
    test.sort_unstable();
    test.dedup();
    Ok((train, test))
}
