//! Rule-based rewards chosen by `data_source`, as verl's `default_compute_score` chooses them.
//!
//! Every function is a pure string function: the caller decodes the response tokens to text.
//! [`RewardRegistry::verl_default`] holds verl's table (`openai/gsm8k`, the MATH sources,
//! `math_dapo`/`math`/`aime*`, the Search-R1 QA sources: `searchR1_*`, `nq`, `triviaqa`,
//! `popqa`, `hotpotqa`, `2wikimultihopqa`, `musique`, `bamboogle`) plus this crate's tasks
//! (`countdown`, `arithmetic`, `word_problems`); [`RewardConfig`] maps more data sources to
//! built-in or registered functions by name, or changes their parameters, e.g. Search-R1's
//! format reward for the synthetic search task:
//!
//! ```toml
//! [reward.prefixes.searchR1_]
//! name = "qa_em"
//! format_score = 0.1   # a well-formed `<answer>` that is wrong; verl's default is 0
//! ```

pub mod arithmetic;
pub mod countdown;
pub mod gsm8k;
pub mod math;
pub mod qa_em;
pub mod role;

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
pub use gsm8k::Gsm8kMethod;

/// A score and the extra values worth logging (`acc`, `pred`, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardOutput {
    /// The scalar reward.
    pub score: f64,
    /// Extra information to log next to the score.
    pub extra: BTreeMap<String, Value>,
}

impl RewardOutput {
    /// A score with no extras.
    pub fn new(score: f64) -> Self {
        Self {
            score,
            extra: BTreeMap::new(),
        }
    }

    /// Adds an extra value.
    pub fn with(mut self, key: &str, value: impl Serialize) -> Self {
        self.extra.insert(
            key.to_string(),
            serde_json::to_value(value).unwrap_or(Value::Null),
        );
        self
    }
}

/// A reward function: `(response text, ground truth, extra_info) -> score`.
pub trait RewardFn: Send + Sync {
    /// Scores one response.
    fn score(
        &self,
        response: &str,
        ground_truth: &Value,
        extra_info: &Value,
    ) -> Result<RewardOutput>;
}

impl<F> RewardFn for F
where
    F: Fn(&str, &Value, &Value) -> Result<RewardOutput> + Send + Sync,
{
    fn score(
        &self,
        response: &str,
        ground_truth: &Value,
        extra_info: &Value,
    ) -> Result<RewardOutput> {
        self(response, ground_truth, extra_info)
    }
}

/// The last `n` characters of `s` (Python's `s[-n:]`).
pub(crate) fn python_tail(s: &str, n: usize) -> &str {
    if n == 0 {
        return "";
    }
    match s.char_indices().rev().nth(n - 1) {
        Some((i, _)) => &s[i..],
        None => s,
    }
}

fn gt_error(reward: &str, gt: &Value, message: &str) -> Error {
    Error::GroundTruth {
        reward: reward.into(),
        ground_truth: gt.to_string(),
        message: message.into(),
    }
}

/// The ground truth as a string (numbers are written as JSON writes them).
fn gt_string(reward: &str, gt: &Value) -> Result<String> {
    match gt {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        other => Err(gt_error(reward, other, "expected a string")),
    }
}

/// A built-in reward function with its parameters; `name` selects it in config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case", deny_unknown_fields)]
pub enum RewardFnConfig {
    /// verl's `gsm8k.compute_score`.
    Gsm8k {
        /// `strict` (`#### N`) or `flexible` (last number).
        #[serde(default)]
        method: Gsm8kMethod,
        /// Score for a found but wrong answer.
        #[serde(default)]
        format_score: f64,
        /// Score for a correct answer.
        #[serde(default = "one")]
        score: f64,
    },
    /// verl's `math_reward.compute_score` (last `\boxed{}`).
    Math,
    /// verl's `math_dapo.compute_score` (`Answer:`; ±1).
    MathDapo {
        /// Compare the last `\boxed{}` verbatim instead.
        #[serde(default)]
        strict_box_verify: bool,
    },
    /// TinyZero's countdown; ground truth `{target, numbers}`.
    Countdown {
        /// Score for a well-formed but wrong equation.
        #[serde(default = "tenth")]
        format_score: f64,
        /// Score for a correct equation.
        #[serde(default = "one")]
        score: f64,
    },
    /// Last number equals the ground truth.
    Arithmetic,
    /// Search-R1 exact match (verl's `search_r1_like_qa_em`); ground truth
    /// `{target: str | [str]}` or a string / list.
    QaEm {
        /// Search-R1's `format_score`: the score of a response with an `<answer>...</answer>`
        /// that does not match (a response without one scores 0); default 0, as verl.
        #[serde(default)]
        format_score: f64,
        /// Score for a match.
        #[serde(default = "one")]
        score: f64,
    },
    /// A function registered in code with [`RewardRegistry::register_function`].
    Custom {
        /// The registered name.
        function: String,
    },
}

fn one() -> f64 {
    1.0
}
fn tenth() -> f64 {
    0.1
}

/// Which reward function scores which `data_source`, beyond verl's defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    /// `data_source` → function, e.g. `[reward.sources."my/gsm8k"] name = "gsm8k"`.
    pub sources: BTreeMap<String, RewardFnConfig>,
    /// `data_source` prefixes → function (`"aime"` matches `aime2024`).
    pub prefixes: BTreeMap<String, RewardFnConfig>,
}

fn qa_targets(gt: &Value) -> Result<Vec<String>> {
    let t = match gt {
        Value::Object(m) => m
            .get("target")
            .ok_or_else(|| gt_error("qa_em", gt, "an object needs `target`"))?,
        other => other,
    };
    match t {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(a) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| gt_error("qa_em", gt, "targets must be strings"))
            })
            .collect(),
        _ => Err(gt_error(
            "qa_em",
            gt,
            "expected a string or a list of strings",
        )),
    }
}

fn countdown_gt(gt: &Value) -> Result<(f64, Vec<i64>)> {
    let parsed;
    let obj = match gt {
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s)
                .map_err(|_| gt_error("countdown", gt, "expected {target, numbers}"))?;
            &parsed
        }
        other => other,
    };
    let target = obj
        .get("target")
        .and_then(Value::as_f64)
        .ok_or_else(|| gt_error("countdown", gt, "needs a numeric `target`"))?;
    let numbers = obj
        .get("numbers")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
        .ok_or_else(|| gt_error("countdown", gt, "needs integer `numbers`"))?;
    Ok((target, numbers))
}

/// Builds the function a config names (`Custom` is resolved by the registry).
fn builtin(cfg: &RewardFnConfig) -> Option<Arc<dyn RewardFn>> {
    let f: Arc<dyn RewardFn> = match cfg.clone() {
        RewardFnConfig::Gsm8k {
            method,
            format_score,
            score,
        } => Arc::new(move |r: &str, gt: &Value, _: &Value| {
            Ok(gsm8k::compute_score(
                r,
                &gt_string("gsm8k", gt)?,
                method,
                format_score,
                score,
            ))
        }),
        RewardFnConfig::Math => Arc::new(|r: &str, gt: &Value, _: &Value| {
            Ok(math::compute_score(r, &gt_string("math", gt)?))
        }),
        RewardFnConfig::MathDapo { strict_box_verify } => {
            Arc::new(move |r: &str, gt: &Value, _: &Value| {
                Ok(math::compute_score_dapo(
                    r,
                    &gt_string("math_dapo", gt)?,
                    strict_box_verify,
                ))
            })
        }
        RewardFnConfig::Countdown {
            format_score,
            score,
        } => Arc::new(move |r: &str, gt: &Value, _: &Value| {
            let (target, numbers) = countdown_gt(gt)?;
            Ok(countdown::compute_score(
                r,
                target,
                &numbers,
                format_score,
                score,
            ))
        }),
        RewardFnConfig::Arithmetic => Arc::new(|r: &str, gt: &Value, _: &Value| {
            Ok(arithmetic::compute_score(r, &gt_string("arithmetic", gt)?))
        }),
        RewardFnConfig::QaEm {
            format_score,
            score,
        } => Arc::new(move |r: &str, gt: &Value, _: &Value| {
            Ok(qa_em::compute_score(
                r,
                &qa_targets(gt)?,
                format_score,
                score,
            ))
        }),
        RewardFnConfig::Custom { .. } => return None,
    };
    Some(f)
}

/// `data_source` → reward function.
#[derive(Clone, Default)]
pub struct RewardRegistry {
    sources: BTreeMap<String, Arc<dyn RewardFn>>,
    prefixes: Vec<(String, Arc<dyn RewardFn>)>,
    functions: BTreeMap<String, Arc<dyn RewardFn>>,
}

impl std::fmt::Debug for RewardRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardRegistry")
            .field("sources", &self.sources.keys().collect::<Vec<_>>())
            .field(
                "prefixes",
                &self.prefixes.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .field("functions", &self.functions.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl RewardRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// verl's `default_compute_score` table plus this crate's synthetic tasks.
    pub fn verl_default() -> Self {
        let mut r = Self::new();
        let gsm8k = RewardFnConfig::Gsm8k {
            method: Gsm8kMethod::Strict,
            format_score: 0.0,
            score: 1.0,
        };
        let qa = RewardFnConfig::QaEm {
            format_score: 0.0,
            score: 1.0,
        };
        let dapo = RewardFnConfig::MathDapo {
            strict_box_verify: false,
        };
        let table: Vec<(&str, &RewardFnConfig)> = vec![
            ("openai/gsm8k", &gsm8k),
            ("lighteval/MATH", &RewardFnConfig::Math),
            ("DigitalLearningGmbH/MATH-lighteval", &RewardFnConfig::Math),
            ("HuggingFaceH4/MATH-500", &RewardFnConfig::Math),
            ("math_dapo", &dapo),
            ("math", &dapo),
            ("math_dapo_reasoning", &dapo),
            ("searchR1_nq", &qa),
            ("searchR1_triviaqa", &qa),
            ("searchR1_popqa", &qa),
            ("searchR1_hotpotqa", &qa),
            ("searchR1_2wikimultihopqa", &qa),
            ("searchR1_musique", &qa),
            ("searchR1_bamboogle", &qa),
            // Search-R1's own preprocessing names the sources without the prefix.
            ("nq", &qa),
            ("triviaqa", &qa),
            ("popqa", &qa),
            ("hotpotqa", &qa),
            ("2wikimultihopqa", &qa),
            ("musique", &qa),
            ("bamboogle", &qa),
            (
                "countdown",
                &RewardFnConfig::Countdown {
                    format_score: 0.1,
                    score: 1.0,
                },
            ),
            ("arithmetic", &RewardFnConfig::Arithmetic),
            ("word_problems", &gsm8k),
        ];
        for (name, cfg) in table {
            if let Some(f) = builtin(cfg) {
                r.sources.insert(name.to_string(), f);
            }
        }
        if let Some(f) = builtin(&dapo) {
            r.prefixes.push(("aime".into(), f));
        }
        // Every other Search-R1 source (`searchR1_synthetic`, ...) is QA exact match too.
        if let Some(f) = builtin(&qa) {
            r.prefixes.push(("searchR1_".into(), f));
        }
        r
    }

    /// [`RewardRegistry::verl_default`] with `cfg`'s mappings applied on top (a configured
    /// prefix or source replaces the default of the same name).
    pub fn with_config(cfg: &RewardConfig) -> Result<Self> {
        let mut r = Self::verl_default();
        r.apply_config(cfg)?;
        Ok(r)
    }

    /// Scores `data_source` with `f` (replacing any previous function).
    pub fn register_source(&mut self, data_source: impl Into<String>, f: Arc<dyn RewardFn>) {
        self.sources.insert(data_source.into(), f);
    }

    /// Makes `f` available to config as `{ name = "custom", function = "<name>" }`.
    pub fn register_function(&mut self, name: impl Into<String>, f: Arc<dyn RewardFn>) {
        self.functions.insert(name.into(), f);
    }

    fn resolve(&self, cfg: &RewardFnConfig) -> Result<Arc<dyn RewardFn>> {
        if let RewardFnConfig::Custom { function } = cfg {
            return self
                .functions
                .get(function)
                .cloned()
                .ok_or_else(|| Error::Config {
                    key: format!("reward function `{function}`"),
                    message: format!(
                        "not registered (registered: {})",
                        self.functions
                            .keys()
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
        }
        builtin(cfg).ok_or_else(|| Error::Config {
            key: "reward".into(),
            message: "unresolvable".into(),
        })
    }

    /// Applies config mappings on top of what is registered.
    pub fn apply_config(&mut self, cfg: &RewardConfig) -> Result<()> {
        for (source, f) in &cfg.sources {
            let f = self.resolve(f)?;
            self.sources.insert(source.clone(), f);
        }
        for (prefix, f) in &cfg.prefixes {
            let f = self.resolve(f)?;
            // replaces a registered prefix of the same name (e.g. the default `searchR1_`)
            self.prefixes.retain(|(p, _)| p != prefix);
            self.prefixes.insert(0, (prefix.clone(), f));
        }
        Ok(())
    }

    /// The function for `data_source`: an exact name first, then the longest matching prefix.
    pub fn get(&self, data_source: &str) -> Result<Arc<dyn RewardFn>> {
        if let Some(f) = self.sources.get(data_source) {
            return Ok(f.clone());
        }
        self.prefixes
            .iter()
            .filter(|(p, _)| data_source.starts_with(p.as_str()))
            .max_by_key(|(p, _)| p.len())
            .map(|(_, f)| f.clone())
            .ok_or_else(|| Error::UnknownDataSource {
                data_source: data_source.to_string(),
                registered: self
                    .sources
                    .keys()
                    .cloned()
                    .chain(self.prefixes.iter().map(|(p, _)| format!("{p}*")))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// Scores one response by its `data_source`.
    pub fn score(
        &self,
        data_source: &str,
        response: &str,
        ground_truth: &Value,
        extra_info: &Value,
    ) -> Result<RewardOutput> {
        self.get(data_source)?
            .score(response, ground_truth, extra_info)
    }
}

#[cfg(test)]
mod tests;
