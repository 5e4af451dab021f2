//! Rule-based rewards chosen by `data_source`, as verl's `default_compute_score` chooses them.
//!
//! The caller decodes the response tokens to text. [`RewardRegistry::verl_default`] holds two
//! tables, kept apart so that a user can tell which dispatch is verl's: [`verl_table`] (exactly
//! the data sources verl's `default_compute_score` scores) and [`extension_table`] (data sources
//! verl refuses that this crate scores: its synthetic tasks, Search-R1's unprefixed names).
//! [`RewardConfig`] maps more data sources to built-in or registered functions by name, or
//! changes their parameters, e.g. Search-R1's format reward for the synthetic search task:
//!
//! ```toml
//! [reward.prefixes.searchR1_]
//! name = "qa_em"
//! format_score = 0.1   # a well-formed `<answer>` that is wrong; verl's default is 0
//! ```
//!
//! Most functions are Rust string functions. Python runs in three cases, each through the pool
//! of [`python`]: verl's `custom_reward_function` (a user's file, run unchanged, scoring every
//! row as in verl), and the three verl scorers that need a Python package (`geo3k` with
//! mathruler, `math_verify` with math-verify, `prime_math` with verl's own code), started only
//! when a batch names them. [`remote`] scores
//! every row on an HTTP server instead (`reward.remote_url`, OpenRLHF's remote reward).

pub mod arithmetic;
pub mod countdown;
pub mod gsm8k;
pub mod math;
pub mod python;
pub mod qa_em;
pub mod remote;
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

/// One row to score: what verl's reward managers hand `compute_score`, plus the prompt (for
/// remote scorers, which see the whole text as OpenRLHF's do).
#[derive(Debug, Clone, Copy)]
pub struct ScoreRow<'a> {
    /// The row's `data_source`.
    pub data_source: &'a str,
    /// The decoded prompt.
    pub prompt: &'a str,
    /// The decoded response (verl's `solution_str`).
    pub response: &'a str,
    /// The row's ground truth.
    pub ground_truth: &'a Value,
    /// The row's `extra_info` (`null` when the data has none).
    pub extra_info: &'a Value,
}

impl<'a> ScoreRow<'a> {
    /// A row of what [`RewardFn::score`] gets: no data source or prompt.
    pub fn of_response(response: &'a str, ground_truth: &'a Value, extra_info: &'a Value) -> Self {
        ScoreRow {
            data_source: "",
            prompt: "",
            response,
            ground_truth,
            extra_info,
        }
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

    /// Scores many rows at once (one output per row, in order); the Python pool and the
    /// remote scorer spread them over their workers or send them in one request.
    fn score_batch(&self, rows: &[ScoreRow<'_>]) -> Result<Vec<RewardOutput>> {
        rows.iter()
            .map(|r| self.score(r.response, r.ground_truth, r.extra_info))
            .collect()
    }
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

/// Python's `str.isspace()` for one character: Unicode's White_Space plus U+001C..U+001F
/// (the file, group, record and unit separators), which Rust's `char::is_whitespace` omits.
pub(crate) fn py_whitespace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `s.strip()`.
pub(crate) fn py_strip(s: &str) -> &str {
    s.trim_matches(py_whitespace)
}

/// Python's `s.split()`.
pub(crate) fn py_split_whitespace(s: &str) -> impl Iterator<Item = &str> {
    s.split(py_whitespace).filter(|w| !w.is_empty())
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
    /// verl's `search_r1_like_qa_em.compute_score_subem`: a match when a normalised target is a
    /// substring of the normalised answer (no quarter score for many answer tags).
    QaSubem {
        /// The score of a response with an `<answer>...</answer>` that does not match.
        #[serde(default)]
        format_score: f64,
        /// Score for a match.
        #[serde(default = "one")]
        score: f64,
    },
    /// verl's `geo3k.compute_score` (`hiyouga/geometry3k`), run through the Python bridge with
    /// the PyPI package mathruler in `reward.python`.
    Geo3k {
        /// Weight of the format check (`<think>...</think>` then `\boxed{}`); default 0.1.
        #[serde(default = "tenth")]
        format_score: f64,
        /// Grade the last `\boxed{}` content (default) rather than the whole response.
        #[serde(default = "yes")]
        use_boxed: bool,
    },
    /// verl's `math_verify.compute_score`, run through the Python bridge with the PyPI package
    /// math-verify in `reward.python`.
    MathVerify {
        /// Score when math-verify's own timeout fires; default 0.
        #[serde(default)]
        timeout_score: f64,
    },
    /// verl's `prime_math.compute_score` (its `numina_*` data sources): verl's own code, run
    /// through the Python bridge with the PyPI package verl (without its dependencies), sympy,
    /// pylatexenc and numpy in `reward.python`; 1 when it judges the answer correct, else 0.
    PrimeMath,
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
fn yes() -> bool {
    true
}

/// Which reward function scores which `data_source`, beyond verl's defaults, and how Python
/// and remote rewards run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    /// `data_source` → function, e.g. `[reward.sources."my/gsm8k"] name = "gsm8k"`.
    pub sources: BTreeMap<String, RewardFnConfig>,
    /// `data_source` prefixes → function (`"aime"` matches `aime2024`).
    pub prefixes: BTreeMap<String, RewardFnConfig>,
    /// The Python interpreter that runs `custom_reward_function.path` and the bridged scorers
    /// (geo3k, math_verify, prime_math); point it at the environment that has your file's
    /// imports. Default `python3`.
    pub python: String,
    /// Persistent Python worker processes scoring a batch in parallel. Default 4.
    pub workers: usize,
    /// Seconds one Python `compute_score` call may take before its worker is killed and
    /// restarted and the row counts as failed. Default 30.
    pub timeout_s: f64,
    /// What a failed Python row (an exception, a timeout, a return that is not a score, a
    /// worker that died twice on it) becomes: `raise` (the step fails with the traceback) or
    /// `zero` (the row scores 0 and `reward/failed_score/mean` counts it). Default `raise`.
    pub on_error: python::OnError,
    /// OpenRLHF-style remote reward: every row is scored by POSTing batches to this URL
    /// (`{"query", "prompts", "responses", "labels", "data_sources", "extra_info"}` in, `{"rewards"}`
    /// out) instead of by `data_source`. Default none.
    pub remote_url: Option<String>,
    /// Rows per request to `reward.remote_url`. Default 256.
    pub remote_batch_size: usize,
    /// Seconds one request to `reward.remote_url` may take. Default 60.
    pub remote_timeout_s: f64,
}

impl Default for RewardConfig {
    fn default() -> Self {
        let pool = python::PoolSettings::default();
        Self {
            sources: BTreeMap::new(),
            prefixes: BTreeMap::new(),
            python: pool.python,
            workers: pool.workers,
            timeout_s: pool.timeout_s,
            on_error: pool.on_error,
            remote_url: None,
            remote_batch_size: 256,
            remote_timeout_s: 60.0,
        }
    }
}

impl RewardConfig {
    /// The Python pool settings of this group.
    pub fn pool_settings(&self) -> python::PoolSettings {
        python::PoolSettings {
            python: self.python.clone(),
            workers: self.workers,
            timeout_s: self.timeout_s,
            on_error: self.on_error,
        }
    }
}

/// verl's `custom_reward_function` group: a Python file whose function scores every row, as
/// verl's reward managers call it (`compute_score(data_source, solution_str, ground_truth,
/// extra_info, **reward_kwargs)`, returning a number or a dict with a `score`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CustomRewardFunction {
    /// The `.py` file (run unchanged by `reward.python`); unset, rows are scored by
    /// `data_source`. Default none.
    pub path: Option<std::path::PathBuf>,
    /// The function's name in the file. Default `compute_score`.
    pub name: String,
    /// Keyword arguments added to every call (verl's `reward_kwargs`). Default none.
    pub reward_kwargs: serde_json::Map<String, Value>,
}

impl Default for CustomRewardFunction {
    fn default() -> Self {
        Self {
            path: None,
            name: "compute_score".into(),
            reward_kwargs: serde_json::Map::new(),
        }
    }
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

/// A scorer of the Python bridge, started on first use.
fn bridged(
    file: &str,
    kwargs: serde_json::Map<String, Value>,
    pool: &python::PoolSettings,
    hint: &str,
) -> Option<Arc<dyn RewardFn>> {
    let f = python::bridge_function(file, "compute_score", kwargs)?;
    Some(Arc::new(python::LazyPool::new(f, pool.clone(), hint)))
}

/// Builds the function a config names (`Custom` is resolved by the registry); the bridged
/// scorers run under `pool`.
fn builtin(cfg: &RewardFnConfig, pool: &python::PoolSettings) -> Option<Arc<dyn RewardFn>> {
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
        RewardFnConfig::QaSubem {
            format_score,
            score,
        } => Arc::new(move |r: &str, gt: &Value, _: &Value| {
            Ok(qa_em::compute_score_subem(
                r,
                &qa_targets(gt)?,
                format_score,
                score,
            ))
        }),
        RewardFnConfig::Geo3k {
            format_score,
            use_boxed,
        } => {
            let mut kw = serde_json::Map::new();
            kw.insert("format_score".into(), format_score.into());
            kw.insert("use_boxed".into(), use_boxed.into());
            return bridged(
                "geo3k.py",
                kw,
                pool,
                "geo3k runs verl's grader, mathruler: `pip install mathruler pylatexenc tqdm` into the environment of reward.python",
            );
        }
        RewardFnConfig::MathVerify { timeout_score } => {
            let mut kw = serde_json::Map::new();
            kw.insert("timeout_score".into(), timeout_score.into());
            return bridged(
                "math_verify.py",
                kw,
                pool,
                "math_verify needs Hugging Face's math-verify: `pip install math-verify` into the environment of reward.python",
            );
        }
        RewardFnConfig::PrimeMath => {
            return bridged(
                "prime_math.py",
                serde_json::Map::new(),
                pool,
                "prime_math runs verl's own scorer: `pip install --no-deps verl==0.9.1` and `pip install sympy pylatexenc numpy` into the environment of reward.python (scripts/reward-env does both)",
            );
        }
        RewardFnConfig::Custom { .. } => return None,
    };
    Some(f)
}

/// Which scorer a data source gets: exact names, then prefixes.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchTable {
    /// `data_source` → scorer.
    pub sources: Vec<(&'static str, RewardFnConfig)>,
    /// `data_source` prefix → scorer.
    pub prefixes: Vec<(&'static str, RewardFnConfig)>,
}

/// verl's `default_compute_score` table: exactly the data sources verl scores (a source here
/// is scored as verl scores it), with the prefix `aime` as verl's `startswith("aime")`.
/// Not here: verl's code sources (`codecontests`, `apps`, `codeforces`, `taco`: sandboxed code
/// execution), which this crate does not score.
pub fn verl_table() -> DispatchTable {
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
    let mut sources = vec![
        ("openai/gsm8k", gsm8k),
        ("lighteval/MATH", RewardFnConfig::Math),
        ("DigitalLearningGmbH/MATH-lighteval", RewardFnConfig::Math),
        ("HuggingFaceH4/MATH-500", RewardFnConfig::Math),
        ("math_dapo", dapo.clone()),
        ("math", dapo.clone()),
        ("math_dapo_reasoning", dapo.clone()),
        (
            "hiyouga/geometry3k",
            RewardFnConfig::Geo3k {
                format_score: 0.1,
                use_boxed: true,
            },
        ),
    ];
    for s in NUMINA {
        sources.push((s, RewardFnConfig::PrimeMath));
    }
    for s in SEARCH_R1 {
        sources.push((s.0, qa.clone()));
    }
    DispatchTable {
        sources,
        prefixes: vec![("aime", dapo)],
    }
}

/// The data sources verl scores with prime_math.
const NUMINA: [&str; 6] = [
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
];

/// Search-R1's QA sources: verl's names (`searchR1_` prefix) and Search-R1's own.
const SEARCH_R1: [(&str, &str); 7] = [
    ("searchR1_nq", "nq"),
    ("searchR1_triviaqa", "triviaqa"),
    ("searchR1_popqa", "popqa"),
    ("searchR1_hotpotqa", "hotpotqa"),
    ("searchR1_2wikimultihopqa", "2wikimultihopqa"),
    ("searchR1_musique", "musique"),
    ("searchR1_bamboogle", "bamboogle"),
];

/// This crate's extensions: data sources verl's `default_compute_score` refuses
/// (`NotImplementedError`) that are scored here: the synthetic tasks of [`crate::tasks`],
/// Search-R1's unprefixed source names (its own preprocessing writes them), and every other
/// `searchR1_` source (`searchR1_synthetic`, ...) as QA exact match.
pub fn extension_table() -> DispatchTable {
    let qa = RewardFnConfig::QaEm {
        format_score: 0.0,
        score: 1.0,
    };
    let mut sources = vec![
        (
            "countdown",
            RewardFnConfig::Countdown {
                format_score: 0.1,
                score: 1.0,
            },
        ),
        ("arithmetic", RewardFnConfig::Arithmetic),
        (
            "word_problems",
            RewardFnConfig::Gsm8k {
                method: Gsm8kMethod::Strict,
                format_score: 0.0,
                score: 1.0,
            },
        ),
    ];
    for s in SEARCH_R1 {
        sources.push((s.1, qa.clone()));
    }
    DispatchTable {
        sources,
        prefixes: vec![("searchR1_", qa)],
    }
}

/// `data_source` → reward function; or one function for every row (verl's
/// `custom_reward_function`, or `reward.remote_url`).
#[derive(Clone, Default)]
pub struct RewardRegistry {
    sources: BTreeMap<String, Arc<dyn RewardFn>>,
    prefixes: Vec<(String, Arc<dyn RewardFn>)>,
    functions: BTreeMap<String, Arc<dyn RewardFn>>,
    every_row: Option<(String, Arc<dyn RewardFn>)>,
    pool: python::PoolSettings,
    /// Each built-in scorer built once per configuration, so that the data sources sharing one
    /// (verl's six `numina_*` for prime_math) share its Python pool and are scored as one batch.
    built: Vec<(RewardFnConfig, Arc<dyn RewardFn>)>,
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
            .field("every_row", &self.every_row.as_ref().map(|(n, _)| n))
            .finish()
    }
}

impl RewardRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// verl's `default_compute_score` table ([`verl_table`]) plus this crate's extensions
    /// ([`extension_table`]); the bridged scorers run under the default pool settings.
    pub fn verl_default() -> Self {
        Self::default_with(&python::PoolSettings::default())
    }

    fn default_with(pool: &python::PoolSettings) -> Self {
        let mut r = Self {
            pool: pool.clone(),
            ..Self::new()
        };
        for DispatchTable { sources, prefixes } in [verl_table(), extension_table()] {
            for (name, cfg) in sources {
                if let Some(f) = r.builtin(&cfg) {
                    r.sources.insert(name.to_string(), f);
                }
            }
            for (prefix, cfg) in prefixes {
                if let Some(f) = r.builtin(&cfg) {
                    r.prefixes.push((prefix.to_string(), f));
                }
            }
        }
        r
    }

    /// The built-in scorer `cfg` names, built on first use and shared after.
    fn builtin(&mut self, cfg: &RewardFnConfig) -> Option<Arc<dyn RewardFn>> {
        if let Some((_, f)) = self.built.iter().find(|(c, _)| c == cfg) {
            return Some(f.clone());
        }
        let f = builtin(cfg, &self.pool)?;
        self.built.push((cfg.clone(), f.clone()));
        Some(f)
    }

    /// [`RewardRegistry::verl_default`] with `cfg`'s mappings applied on top (a configured
    /// prefix or source replaces the default of the same name).
    pub fn with_config(cfg: &RewardConfig) -> Result<Self> {
        let mut r = Self::default_with(&cfg.pool_settings());
        r.apply_config(cfg)?;
        Ok(r)
    }

    /// The registry of an experiment: `custom_reward_function.path` (its Python pool started
    /// now, so a file that cannot load fails before training) or `reward.remote_url` scores
    /// every row; otherwise [`RewardRegistry::with_config`]. Both set is an error.
    pub fn build(cfg: &RewardConfig, custom: &CustomRewardFunction) -> Result<Self> {
        let mut r = Self::with_config(cfg)?;
        match (&custom.path, &cfg.remote_url) {
            (Some(_), Some(_)) => {
                return Err(Error::Config {
                    key: "reward.remote_url".into(),
                    message:
                        "custom_reward_function.path is set too: each scores every row, pick one"
                            .into(),
                });
            }
            (Some(path), None) => {
                if custom.name.is_empty() {
                    return Err(Error::Config {
                        key: "custom_reward_function.name".into(),
                        message: "must name the function in the file".into(),
                    });
                }
                let f = python::PythonFunction::file(
                    path.clone(),
                    custom.name.clone(),
                    custom.reward_kwargs.clone(),
                );
                let what = format!(
                    "custom_reward_function `{}` in {}",
                    custom.name,
                    path.display()
                );
                let pool: Arc<dyn RewardFn> =
                    Arc::new(python::PythonPool::start(f, cfg.pool_settings())?);
                r.every_row = Some((what, pool));
            }
            (None, Some(url)) => {
                let scorer: Arc<dyn RewardFn> = Arc::new(remote::RemoteScorer::new(
                    url,
                    cfg.remote_batch_size,
                    cfg.remote_timeout_s,
                )?);
                r.every_row = Some((format!("reward.remote_url {url}"), scorer));
            }
            (None, None) => {}
        }
        Ok(r)
    }

    /// Whether rows are scored by something that can fail per row (Python, remote), so the
    /// reward role reports `failed_score`.
    pub fn may_fail_rows(&self) -> bool {
        self.every_row.is_some() || self.pool.on_error == python::OnError::Zero
    }

    /// What scores every row, when one function does (`custom_reward_function`, remote).
    pub fn every_row(&self) -> Option<&str> {
        self.every_row.as_ref().map(|(n, _)| n.as_str())
    }

    /// Scores `data_source` with `f` (replacing any previous function).
    pub fn register_source(&mut self, data_source: impl Into<String>, f: Arc<dyn RewardFn>) {
        self.sources.insert(data_source.into(), f);
    }

    /// Makes `f` available to config as `{ name = "custom", function = "<name>" }`.
    pub fn register_function(&mut self, name: impl Into<String>, f: Arc<dyn RewardFn>) {
        self.functions.insert(name.into(), f);
    }

    fn resolve(&mut self, cfg: &RewardFnConfig) -> Result<Arc<dyn RewardFn>> {
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
        self.builtin(cfg).ok_or_else(|| Error::Config {
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

    /// The function for `data_source`: the one scoring every row if set, else an exact name,
    /// then the longest matching prefix.
    pub fn get(&self, data_source: &str) -> Result<Arc<dyn RewardFn>> {
        if let Some((_, f)) = &self.every_row {
            return Ok(f.clone());
        }
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
        let row = ScoreRow {
            data_source,
            prompt: "",
            response,
            ground_truth,
            extra_info,
        };
        self.get(data_source)?
            .score_batch(std::slice::from_ref(&row))?
            .pop()
            .ok_or_else(|| Error::Config {
                key: "reward".into(),
                message: format!("no score for data_source `{data_source}`"),
            })
    }

    /// Scores every row, each by its `data_source`; rows sharing a function go to it as one
    /// batch (one Python pool call, one remote request per `reward.remote_batch_size`).
    pub fn score_batch(&self, rows: &[ScoreRow<'_>]) -> Result<Vec<RewardOutput>> {
        let mut groups: Vec<(Arc<dyn RewardFn>, Vec<usize>)> = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            let f = self.get(row.data_source)?;
            match groups.iter_mut().find(|(g, _)| Arc::ptr_eq(g, &f)) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((f, vec![i])),
            }
        }
        let mut out: Vec<Option<RewardOutput>> = vec![None; rows.len()];
        for (f, idx) in groups {
            let part: Vec<ScoreRow<'_>> = idx.iter().map(|&i| rows[i]).collect();
            let scored = f.score_batch(&part)?;
            if scored.len() != part.len() {
                return Err(Error::Config {
                    key: "reward".into(),
                    message: format!("{} scores for {} rows", scored.len(), part.len()),
                });
            }
            for (i, o) in idx.into_iter().zip(scored) {
                out[i] = Some(o);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }
}

#[cfg(test)]
mod tests;
