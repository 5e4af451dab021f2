//! The experiment config: the crates' own config groups composed under verl's names, layered
//! (defaults → TOML file → `RL_` environment → `key.path=value` overrides) with figment, with
//! unknown keys reported by name and the nearest valid key suggested.
//!
//! The configuration layer of the harness: it knows the keys, their defaults and their rules,
//! and nothing about running (it sits below `run`, `analysis` and `integrations`, above
//! `store` whose filter language `trainer.stop_when` is written in). Its parts: this file (the
//! top-level [`ExperimentConfig`], layering, validation, key listings), [`groups`] (the LLM
//! groups under verl's names), [`checks`] (the rules of the groups a trainer reads and the
//! trainers' configs derived from them), [`verl`] and [`from_verl`] (verl's command lines and
//! configs), and the generated reference (`docs`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::bandit::BanditConfig;
use crate::suggest::nearest_key;
use groups::{ActorRolloutRef, CriticGroup, DpoGroup, RewardModelGroup, SftGroup};

/// Which trainer drives the run (`trainer.algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainerKind {
    /// The harness's own small deterministic contextual-bandit policy-gradient trainer
    /// (`[bandit]` group): seconds on CPU, used by the harness's tests and the quickstart.
    #[default]
    Bandit,
    /// Supervised fine-tuning of `actor_rollout_ref.model` on the `data` group's files, the
    /// target response read from `sft.response_key` (verl's SFT trainer).
    Sft,
    /// The on-policy family (verl's `main_ppo`): PPO with a critic, GRPO, Dr.GRPO, RLOO,
    /// REINFORCE++, DAPO, GSPO; `algorithm.adv_estimator` and
    /// `actor_rollout_ref.actor.{policy_loss.loss_mode, loss_agg_mode}` choose which.
    OnPolicy,
    /// Offline DPO (and IPO, hinge, reference-free: `dpo.loss_type`) on the
    /// `preference_data` pairs.
    Dpo,
    /// Online DPO: `dpo.n` generations per `data` prompt, the best and worst by the rule reward
    /// as the pair (TRL's OnlineDPOTrainer).
    OnlineDpo,
    /// SPIN: the row's answer (`sft.response_key`) against the policy's own generation, the
    /// reference replaced by the policy every `dpo.ref_update_freq` steps.
    Spin,
    /// A Bradley–Terry reward model on the `preference_data` pairs, initialised from
    /// `actor_rollout_ref.model.path` with a fresh one-label head (`reward_model.train` holds
    /// its settings); each checkpoint's `rm/` folder is what `reward_model.model.path` loads.
    RewardModel,
}

impl TrainerKind {
    /// Whether this kind trains a Hugging Face model from `actor_rollout_ref.model.path` (the
    /// policy, or for `reward_model` a reward model initialised from it).
    pub fn trains_policy(self) -> bool {
        !matches!(self, TrainerKind::Bandit)
    }

    /// Whether this kind runs on several data-parallel ranks: every trainer of a Hugging Face
    /// model does; the harness's bandit runs on one.
    pub fn is_data_parallel(self) -> bool {
        self.trains_policy()
    }

    /// The error for running a kind that [`is_data_parallel`](Self::is_data_parallel) refuses on
    /// several ranks, naming the key and the kinds that are.
    pub fn not_data_parallel(self) -> String {
        // the name as a config file spells it (`bandit`)
        let name = serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| format!("{self:?}"));
        format!(
            "config key `trainer.algorithm`: `{name}` is not data-parallel; run it with one rank \
             (without --nproc-per-node or WORLD_SIZE). on_policy, sft, dpo, online_dpo, spin and \
             reward_model are"
        )
    }
}

/// Remote tracker kinds (`trainer.tracker.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrackerKind {
    /// Runs stay in the local SQLite store only.
    #[default]
    None,
    /// Mirror runs, params and metrics to an MLflow-compatible REST server.
    Mlflow,
}

/// `trainer.tracker`: the remote mirror of the run store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrackerConfig {
    /// `none` or `mlflow`. Default `none`.
    pub kind: TrackerKind,
    /// Base URL of the tracking server, e.g. `http://127.0.0.1:5000`.
    pub uri: String,
    /// Remote experiment name; default: `trainer.project_name`.
    pub experiment: Option<String>,
    /// Timeout of one HTTP request, seconds (> 0). Default 5.
    pub timeout_s: f64,
    /// Seconds between pushes of pending records while training (> 0). Default 2.
    pub interval_s: f64,
    /// At the end of a run, how long to keep pushing before leaving the rest to `harness sync`,
    /// seconds (>= 0). Default 10.
    pub flush_timeout_s: f64,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        TrackerConfig {
            kind: TrackerKind::None,
            uri: "http://127.0.0.1:5000".into(),
            experiment: None,
            timeout_s: 5.0,
            interval_s: 2.0,
            flush_timeout_s: 10.0,
        }
    }
}

/// The harness's `trainer` group (verl's names where verl has them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HarnessConfig {
    /// The trainer to drive. Default `bandit`.
    pub algorithm: TrainerKind,
    /// Project (groups experiments; the remote tracker's experiment). Default `rl-posttrain`.
    pub project_name: String,
    /// The run's name. Default `default`.
    pub experiment_name: String,
    /// Training steps; absent means `total_epochs` epochs of the data; 0 only validates the
    /// model (with `val_before_train`; `harness eval`).
    pub total_training_steps: Option<u64>,
    /// Epochs over the training data when `total_training_steps` is absent (>= 1). Default 1.
    pub total_epochs: u64,
    /// Checkpoint every this many steps (and at the last step); <= 0 = never. Default -1.
    pub save_freq: i64,
    /// Validate every this many steps (and at the last step); <= 0 = never. Default -1.
    pub test_freq: i64,
    /// Validate before the first step. Default true.
    pub val_before_train: bool,
    /// Stop training early at the first validation after a step whose metrics satisfy this
    /// condition, in the `harness runs --filter` language over validation metrics
    /// (`"val/loss < 0.8"`, `"val/test_score/arithmetic >= 0.3 or val/loss < 0.5"`). The run
    /// then checkpoints, exports and ends as finished, with a `stop_when` event naming the step
    /// and the values. Needs `trainer.test_freq` > 0; absent = train every step.
    pub stop_when: Option<String>,
    /// Validation generations printed to the log per validation. Default 0.
    pub log_val_generations: usize,
    /// Steps during which only the critic is updated (PPO with a critic). Default 0.
    pub critic_warmup: u64,
    /// Where the trained policy (a `reward_model` run: the reward model) is written at the end
    /// as a Hugging Face folder (weights, `config.json`, tokenizer files); absent =
    /// `<run dir>/model` only.
    pub export_dir: Option<PathBuf>,
    /// Keep at most this many checkpoints (oldest deleted first); absent = keep all.
    pub max_ckpt_to_keep: Option<u64>,
    /// `cpu`, `cuda` or `cuda:N`. Default `cpu`.
    pub device: String,
    /// The library that computes the models' f32 projections on the CPU: `onednn` (oneDNN's
    /// kernels, AVX-512 wherever the CPU has it; on AMD CPUs about 1.6x MKL's speed) or `blas`
    /// (libtorch's `linear`, MKL's `sgemm`). The two round differently (about 1e-6
    /// relative). Process-wide: every model of the run uses it. Default `onednn`.
    pub cpu_gemm: rl_workers::gemm::CpuGemm,
    /// The run's seed (the trainer derives every RNG stream from it). Default 1.
    pub seed: u64,
    /// Folder of run directories. Default `runs`.
    pub runs_dir: PathBuf,
    /// The SQLite run store; absent = `<runs_dir>/harness.db`.
    pub db: Option<PathBuf>,
    /// Seconds between heartbeats (> 0); a run silent for 3 heartbeats is shown as dead.
    /// Default 5.
    pub heartbeat_s: f64,
    /// Seconds the run store may refuse every write (its lock held by another process, a full
    /// disk) before the run fails; until then the rows wait and are retried, never dropped.
    /// Default 300.
    pub store_patience_s: f64,
    /// Consecutive steps whose loss (any metric named `*loss`) is NaN or infinite after which
    /// the run stops with an error naming the step it diverged at; no checkpoint is taken of a
    /// step with a non-finite loss. 0 turns the guard off. Default 3.
    pub max_nonfinite_steps: u64,
    /// Print a line of the step's key metrics (verl's console logger) every this many steps;
    /// 0 never. Absent: every step when stderr is not a terminal (a log file, nohup, Slurm,
    /// CI), never on a terminal, where the progress bar shows the steps.
    pub console_every_steps: Option<u64>,
    /// Also write each step's metrics as TensorBoard event files (verl's logger
    /// `tensorboard`). Default false.
    pub tensorboard: bool,
    /// Where the event files go; absent: `$TENSORBOARD_DIR` when set (as verl), else
    /// `<run dir>/tensorboard`.
    pub tensorboard_dir: Option<PathBuf>,
    /// The remote tracker.
    pub tracker: TrackerConfig,
}

impl Default for HarnessConfig {
    fn default() -> Self {
        HarnessConfig {
            algorithm: TrainerKind::Bandit,
            project_name: "rl-posttrain".into(),
            experiment_name: "default".into(),
            total_training_steps: None,
            total_epochs: 1,
            save_freq: -1,
            test_freq: -1,
            val_before_train: true,
            stop_when: None,
            log_val_generations: 0,
            critic_warmup: 0,
            export_dir: None,
            max_ckpt_to_keep: None,
            device: "cpu".into(),
            cpu_gemm: rl_workers::gemm::CpuGemm::OneDnn,
            seed: 1,
            runs_dir: PathBuf::from("runs"),
            db: None,
            heartbeat_s: 5.0,
            store_patience_s: 300.0,
            max_nonfinite_steps: 3,
            console_every_steps: None,
            tensorboard: false,
            tensorboard_dir: None,
            tracker: TrackerConfig::default(),
        }
    }
}

impl HarnessConfig {
    /// The run store's path.
    pub fn db_path(&self) -> PathBuf {
        self.db
            .clone()
            .unwrap_or_else(|| self.runs_dir.join("harness.db"))
    }
}

/// One experiment: every config group, as the TOML file spells it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExperimentConfig {
    /// The harness's group: names, schedule, checkpoints, store, tracker.
    pub trainer: HarnessConfig,
    /// verl's `data` group.
    pub data: rl_data::DataConfig,
    /// verl's `actor_rollout_ref` group.
    pub actor_rollout_ref: ActorRolloutRef,
    /// verl's `critic` group (PPO with `algorithm.adv_estimator = "gae"`).
    pub critic: CriticGroup,
    /// verl's `reward_model` group.
    pub reward_model: RewardModelGroup,
    /// verl's `algorithm` group.
    pub algorithm: rl_algos::AlgoConfig,
    /// The SFT trainer's group.
    pub sft: SftGroup,
    /// The preference trainers' group (`trainer.algorithm` = `dpo`, `online_dpo` or `spin`).
    pub dpo: DpoGroup,
    /// Offline DPO's pairs, in TRL's schema (`prompt`, `chosen`, `rejected` columns).
    pub preference_data: rl_data::PreferenceDataConfig,
    /// The bandit trainer's group.
    pub bandit: BanditConfig,
    /// Rule rewards beyond verl's `data_source` table: `[reward.sources."my/qa"] name = "qa_em"`,
    /// `[reward.prefixes.searchR1_] name = "qa_em", format_score = 0.1`; the Python pool and
    /// remote scorer settings.
    pub reward: rl_data::reward::RewardConfig,
    /// verl's `custom_reward_function` group: a Python file whose function scores every row.
    pub custom_reward_function: rl_data::reward::CustomRewardFunction,
    /// Rollout beside the update (verl's one-step off-policy and bounded staleness): the on-policy
    /// trainer generates the next steps' batches in a background thread on its own copy of the
    /// policy (or on `actor_rollout_ref.rollout.server_url`) while the actor trains.
    pub async_training: rl_algos::trainer::AsyncTrainingConfig,
}

/// Keys that may change when a run is resumed (their change is recorded as an event);
/// a prefix ending in `.` covers a whole group.
pub const RESUME_SAFE_KEYS: &[&str] = &[
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.max_ckpt_to_keep",
    "trainer.heartbeat_s",
    "trainer.store_patience_s",
    "trainer.max_nonfinite_steps",
    "trainer.console_every_steps",
    "trainer.tensorboard",
    "trainer.tensorboard_dir",
    "trainer.experiment_name",
    "trainer.tracker.",
    "trainer.log_val_generations",
    "trainer.export_dir",
    // how the optimiser state is laid out over the ranks, as the world size may change
    "actor_rollout_ref.actor.zero_stage",
    "critic.zero_stage",
    "reward_model.train.zero_stage",
    "bandit.step_delay_ms",
    "bandit.val_delay_ms",
    "bandit.diverge_at_step",
];

/// Whether `key` may change on resume.
pub fn resume_safe(key: &str) -> bool {
    RESUME_SAFE_KEYS.iter().any(|safe| {
        if safe.ends_with('.') {
            key.starts_with(safe)
        } else {
            key == *safe
        }
    })
}

/// A `key.path=value` override from the command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// The dotted key path.
    pub key: String,
    /// The value, parsed as a TOML value (a bare word is a string); `None` unsets an optional
    /// key (`null`, `None`).
    pub value: Option<toml::Value>,
}

impl Override {
    /// `key.path=value` setting `value`.
    pub fn set(key: &str, value: toml::Value) -> Override {
        Override {
            key: key.into(),
            value: Some(value),
        }
    }

    /// Parses `key.path=value` as verl's command lines write it: the value as TOML (`3`, `0.1`,
    /// `true`, `'grpo'`, `[1, 2]`) or in Hydra's spellings (`True`, `None`, `[a,b]`; see
    /// [`verl::parse_value`]), anything else a plain string; Hydra's `+key` and `++key` (add a
    /// key) are the key itself.
    pub fn parse(arg: &str) -> Result<Override> {
        let (key, raw) = arg
            .split_once('=')
            .with_context(|| format!("override `{arg}` is not of the form key.path=value"))?;
        let key = key.trim().trim_start_matches('+');
        if key.starts_with('~') {
            bail!(
                "override `{arg}`: Hydra's `~key` (delete a key) has no meaning here; \
                 `key=null` unsets an optional key"
            );
        }
        if key.is_empty() || key.split('.').any(str::is_empty) {
            bail!("override `{arg}`: empty key path");
        }
        Ok(Override {
            key: key.into(),
            value: verl::parse_value(raw),
        })
    }

    /// The value as it would be written back on a command line.
    pub fn value_text(&self) -> String {
        self.value
            .as_ref()
            .map_or_else(|| "null".into(), toml::Value::to_string)
    }
}

/// Where the layers of a config come from.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// The TOML file (None: defaults only).
    pub file: Option<PathBuf>,
    /// Read `RL_` environment variables (`RL_TRAINER__SAVE_FREQ=5` sets `trainer.save_freq`).
    pub env: bool,
    /// Command-line overrides, applied last.
    pub overrides: Vec<Override>,
}

/// A provider under a name that errors report (a file path, `override trainer.seed`).
struct Named<P> {
    inner: P,
    name: String,
}

impl<P> Named<P> {
    fn new(inner: P, name: String) -> Self {
        Named { inner, name }
    }
}

impl<P: figment::Provider> figment::Provider for Named<P> {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(self.name.clone())
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        self.inner.data()
    }

    fn profile(&self) -> Option<figment::Profile> {
        self.inner.profile()
    }
}

/// Resolves the layers into an [`ExperimentConfig`], checked.
pub fn load(sources: &Sources) -> Result<ExperimentConfig> {
    let cfg = layered(sources)?;
    validate(&cfg)?;
    Ok(cfg)
}

/// The layers resolved and type-checked, without [`validate`]'s cross-key checks.
fn layered(sources: &Sources) -> Result<ExperimentConfig> {
    let mut fig = Figment::from(Serialized::defaults(ExperimentConfig::default()));
    let mut file_notes = Vec::new();
    if let Some(file) = &sources.file {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("reading config file {}", file.display()))?;
        // A sweep file's `[sweep]` table describes the search, not the experiment.
        let mut table: toml::Table = toml::from_str(&text)
            .with_context(|| format!("parsing config file {}", file.display()))?;
        table.remove("sweep");
        strip_foreign(&mut table, "", &mut file_notes)
            .with_context(|| format!("config file {}", file.display()))?;
        fig = fig.merge(Named::new(
            Toml::string(&toml::to_string(&table)?),
            file.display().to_string(),
        ));
    }
    let known = known_keys();
    let mut notes = file_notes;
    if sources.env {
        for (name, value) in std::env::vars() {
            let Some(rest) = name.strip_prefix("RL_") else {
                continue;
            };
            let key = rest.to_lowercase().replace("__", ".");
            if !is_config_key(&key, &known) {
                // not ours (another tool's RL_ variable): it must not break every command
                notes.push(format!(
                    "environment variable {name} is not a config key (`{key}`); ignored"
                ));
                continue;
            }
            fig = fig.merge(Named::new(
                Serialized::default(&key, verl::parse_value(&value)),
                format!("environment variable {name}"),
            ));
        }
    }
    for given in &sources.overrides {
        for o in foreign_override(given, &known, &mut notes)? {
            fig = fig.merge(Named::new(
                Serialized::default(&o.key, o.value.clone()),
                format!("override {}", given.key),
            ));
        }
    }
    for n in notes {
        note!("harness: note: {n}");
    }
    fig.extract().map_err(explain)
}

/// Takes verl's keys that have no effect here out of a config file's table (with a note each)
/// and maps its `trainer.logger` to the tracker, as [`foreign_override`] does for overrides.
fn strip_foreign(table: &mut toml::Table, prefix: &str, notes: &mut Vec<String>) -> Result<()> {
    let keys: Vec<String> = table.keys().cloned().collect();
    for k in keys {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        if path == "trainer.logger" {
            let value = table.remove(&k);
            let sinks = verl::logger(value.as_ref())?;
            // the file's own settings of these keys win over the logger's
            for (key, v) in sinks.settings() {
                let mut t = &mut *table;
                let (groups, leaf) = key.rsplit_once('.').map_or(("", key), |(g, l)| (g, l));
                for g in groups.split('.').filter(|g| !g.is_empty()) {
                    let entry = t
                        .entry(g)
                        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
                    let toml::Value::Table(inner) = entry else {
                        bail!("config key `trainer.{g}`: expected a table");
                    };
                    t = inner;
                }
                t.entry(leaf).or_insert(v);
            }
            notes.push(format!(
                "trainer.logger: metrics go to {}",
                sinks.describe()
            ));
            continue;
        }
        if let Some(verl::Foreign::NoEffect(why)) = verl::foreign(&path) {
            table.remove(&k);
            notes.push(format!("{path} has no effect here: {why}"));
            continue;
        }
        if let Some(toml::Value::Table(inner)) = table.get_mut(&k) {
            strip_foreign(inner, &path, notes)?;
        }
    }
    Ok(())
}

/// Whether `key` is one of this harness's config keys: a known key, or a key inside an optional
/// group that is unset by default (`algorithm.filter_groups.enable`), whose keys
/// [`known_keys`] cannot list.
pub fn is_config_key(key: &str, known: &[String]) -> bool {
    if known.iter().any(|k| k == key) {
        return true;
    }
    let mut prefix = key;
    while let Some((parent, _)) = prefix.rsplit_once('.') {
        if known.iter().any(|k| k == parent) {
            let dotted = format!("{parent}.");
            return !known.iter().any(|k| k.starts_with(&dotted));
        }
        prefix = parent;
    }
    false
}

/// An override as this harness takes it: itself, verl's `trainer.logger` mapped to the
/// tracker and TensorBoard keys, or nothing (with a note) for a verl key that has no effect
/// here.
fn foreign_override(
    o: &Override,
    known: &[String],
    notes: &mut Vec<String>,
) -> Result<Vec<Override>> {
    if is_config_key(&o.key, known) {
        return Ok(vec![o.clone()]);
    }
    if let Some(ours) = verl::alias(&o.key).filter(|k| is_config_key(k, known)) {
        notes.push(format!("{} is `{ours}` here", o.key));
        return Ok(vec![Override {
            key: ours,
            value: o.value.clone(),
        }]);
    }
    if o.key == "trainer.logger" {
        let sinks = verl::logger(o.value.as_ref())?;
        notes.push(format!(
            "trainer.logger={}: metrics go to {}",
            o.value_text(),
            sinks.describe()
        ));
        return Ok(sinks
            .settings()
            .into_iter()
            .map(|(key, v)| Override::set(&format!("trainer.{key}"), v))
            .collect());
    }
    if let Some(verdict) = verl::one_value(&o.key, o.value.as_ref()) {
        let why = verdict.map_err(|why| anyhow!("config key `{}`: {why}", o.key))?;
        notes.push(format!("{} has no effect here: {why}", o.key));
        return Ok(Vec::new());
    }
    match verl::foreign(&o.key) {
        Some(verl::Foreign::NoEffect(why)) => {
            notes.push(format!("{} has no effect here: {why}", o.key));
            Ok(Vec::new())
        }
        None => Ok(vec![o.clone()]),
    }
}

/// Parses a config stored with a run or a checkpoint (JSON), applying overrides.
pub fn from_stored(json: &str, overrides: &[Override]) -> Result<ExperimentConfig> {
    let mut fig = Figment::from(Serialized::defaults(ExperimentConfig::default()));
    let stored: Value = serde_json::from_str(json).context("parsing the stored config")?;
    fig = fig.merge(Named::new(
        Serialized::defaults(stored),
        "the stored config".into(),
    ));
    for o in overrides {
        fig = fig.merge(Named::new(
            Serialized::default(&o.key, o.value.clone()),
            format!("override {}", o.key),
        ));
    }
    let cfg: ExperimentConfig = fig.extract().map_err(explain)?;
    validate(&cfg)?;
    Ok(cfg)
}

/// Whether `cfg` only validates its model (`trainer.total_training_steps = 0`, `harness eval`).
pub fn eval_only(cfg: &ExperimentConfig) -> bool {
    cfg.trainer.total_training_steps == Some(0)
}

/// The config the trainers are checked and built with: an evaluation's plans one step (the
/// trainers refuse zero), which the harness's drive never takes.
pub fn as_planned(cfg: &ExperimentConfig) -> std::borrow::Cow<'_, ExperimentConfig> {
    if eval_only(cfg) {
        let mut one = cfg.clone();
        one.trainer.total_training_steps = Some(1);
        std::borrow::Cow::Owned(one)
    } else {
        std::borrow::Cow::Borrowed(cfg)
    }
}

/// The Python and remote reward settings, checked before any model loads (the pool itself
/// starts, and loads the file, when the trainer is built).
fn validate_reward_sources(cfg: &ExperimentConfig) -> Result<()> {
    let r = &cfg.reward;
    if r.workers == 0 {
        bail!("config key `reward.workers`: must be at least 1");
    }
    if !(r.timeout_s > 0.0 && r.timeout_s.is_finite()) {
        bail!(
            "config key `reward.timeout_s`: must be a positive number of seconds, got {}",
            r.timeout_s
        );
    }
    let custom = &cfg.custom_reward_function;
    if let Some(path) = &custom.path {
        if !path.is_file() {
            bail!(
                "config key `custom_reward_function.path`: {} is not a file",
                path.display()
            );
        }
        if custom.name.trim().is_empty() {
            bail!("config key `custom_reward_function.name`: must name the function in the file");
        }
        if r.remote_url.is_some() {
            bail!(
                "config keys `custom_reward_function.path` and `reward.remote_url`: each scores every row, set one"
            );
        }
    }
    if let Some(url) = &r.remote_url {
        rl_data::reward::remote::RemoteScorer::new(url, r.remote_batch_size, r.remote_timeout_s)
            .map_err(|e| anyhow!("{e}"))?;
    }
    Ok(())
}

/// Cross-field and range checks of every group.
pub fn validate(cfg: &ExperimentConfig) -> Result<()> {
    rl_data::reward::RewardRegistry::with_config(&cfg.reward)
        .map_err(|e| anyhow!("config group `reward`: {e}"))?;
    validate_reward_sources(cfg)?;
    let t = &cfg.trainer;
    if t.total_training_steps == Some(0) && !t.val_before_train {
        bail!(
            "config key `trainer.total_training_steps`: must be at least 1 (or absent), or 0 \
             with trainer.val_before_train = true to only validate (`harness eval`)"
        );
    }
    if t.total_epochs == 0 {
        bail!("config key `trainer.total_epochs`: must be at least 1");
    }
    if t.max_ckpt_to_keep == Some(0) {
        bail!("config key `trainer.max_ckpt_to_keep`: must be at least 1 (or absent)");
    }
    if !(t.heartbeat_s > 0.0 && t.heartbeat_s.is_finite()) {
        bail!(
            "config key `trainer.heartbeat_s`: must be positive, got {}",
            t.heartbeat_s
        );
    }
    for (k, v) in [
        ("trainer.store_patience_s", t.store_patience_s),
        ("trainer.tracker.timeout_s", t.tracker.timeout_s),
        ("trainer.tracker.interval_s", t.tracker.interval_s),
    ] {
        if !(v > 0.0 && v.is_finite()) {
            bail!("config key `{k}`: must be positive, got {v}");
        }
    }
    if !(t.tracker.flush_timeout_s >= 0.0 && t.tracker.flush_timeout_s.is_finite()) {
        bail!(
            "config key `trainer.tracker.flush_timeout_s`: must be >= 0, got {}",
            t.tracker.flush_timeout_s
        );
    }
    if t.tracker.kind == TrackerKind::Mlflow
        && !(t.tracker.uri.starts_with("http://") || t.tracker.uri.starts_with("https://"))
    {
        bail!(
            "config key `trainer.tracker.uri`: must start with http:// or https://, got {:?}",
            t.tracker.uri
        );
    }
    if let Some(src) = &t.stop_when {
        crate::store::filter::StopWhen::parse(src).context("config key `trainer.stop_when`")?;
        if t.test_freq <= 0 {
            bail!(
                "config key `trainer.stop_when`: is checked at validations, but \
                 `trainer.test_freq` is {} (set it > 0)",
                t.test_freq
            );
        }
    }
    crate::device::parse(&t.device).context("config key `trainer.device`")?;
    cfg.data.validate().context("config group `data`")?;
    cfg.algorithm
        .validate()
        .map_err(|e| anyhow!("config group `algorithm`: {e}"))?;
    cfg.bandit.validate()?;
    checks::check(&as_planned(cfg))?;
    Ok(())
}

/// Every key path of the config (leaves and groups), from the serialised defaults.
pub fn known_keys() -> Vec<String> {
    let value = groups::with_optional_keys(|| {
        serde_json::to_value(ExperimentConfig::default()).unwrap_or(Value::Null)
    });
    let mut out = Vec::new();
    fn walk(prefix: &str, v: &Value, out: &mut Vec<String>) {
        if let Value::Object(map) = v {
            for (k, child) in map {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.push(path.clone());
                walk(&path, child, out);
            }
        }
    }
    walk("", &value, &mut out);
    out
}

/// Turns figment's errors into one-line causes naming the key, its source and, for an
/// unknown key, the nearest valid one.
fn explain(err: figment::Error) -> anyhow::Error {
    use figment::error::Kind;
    let known = known_keys();
    let mut lines = Vec::new();
    for e in err {
        let source = e
            .metadata
            .as_ref()
            .map(|m| match &m.source {
                Some(figment::Source::File(p)) => p.display().to_string(),
                _ => m.name.to_string(),
            })
            .unwrap_or_else(|| "config".into());
        let path = e.path.join(".");
        let line = match &e.kind {
            Kind::UnknownField(field, _) => {
                // figment's path already ends with the field; older versions stop at the parent.
                let key = if e.path.last() == Some(field) || path.is_empty() {
                    if path.is_empty() {
                        field.clone()
                    } else {
                        path.clone()
                    }
                } else {
                    format!("{path}.{field}")
                };
                match nearest_key(&key, &known) {
                    Some(s) => {
                        format!("unknown config key `{key}` (in {source}); did you mean `{s}`?")
                    }
                    None => format!("unknown config key `{key}` (in {source})"),
                }
            }
            Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected) => {
                let actual = match actual.to_string().as_str() {
                    // a `null` override of a key that must have a value
                    "option" => "null".to_string(),
                    other => other.to_string(),
                };
                format!(
                    "config key `{path}` (in {source}): expected {}, found {actual}",
                    in_words(expected)
                )
            }
            // a value of a table that two structs share (experiment::Merged), with its path
            Kind::Message(msg) if msg.starts_with(groups::BAD_VALUE) => {
                let rest = &msg[groups::BAD_VALUE.len()..];
                let (inner, why) = rest.split_once("`: ").unwrap_or((rest, ""));
                let key = if path.is_empty() {
                    inner.to_string()
                } else {
                    format!("{path}.{inner}")
                };
                format!("config key `{key}` (in {source}): {}", serde_in_words(why))
            }
            // an unknown key inside a table that two structs share (experiment::Merged)
            Kind::Message(msg) if msg.starts_with(groups::UNKNOWN_KEY) => {
                let field = msg[groups::UNKNOWN_KEY.len()..]
                    .split('`')
                    .next()
                    .unwrap_or_default();
                let key = if path.is_empty() {
                    field.to_string()
                } else {
                    format!("{path}.{field}")
                };
                match nearest_key(&key, &known) {
                    Some(s) => {
                        format!("unknown config key `{key}` (in {source}); did you mean `{s}`?")
                    }
                    None => format!("unknown config key `{key}` (in {source})"),
                }
            }
            Kind::UnknownVariant(v, expected) => format!(
                "config key `{path}` (in {source}): unknown value `{v}`, expected one of {}",
                expected.join(", ")
            ),
            other => format!("config key `{path}` (in {source}): {other}"),
        };
        lines.push(line);
    }
    anyhow!(lines.join("; "))
}

/// serde's name of an expected type in words (`u64` -> `a non-negative integer`).
fn in_words(expected: &str) -> String {
    match expected {
        "u8" | "u16" | "u32" | "u64" | "usize" => "a non-negative integer".into(),
        "i8" | "i16" | "i32" | "i64" | "isize" => "an integer".into(),
        "f32" | "f64" => "a number".into(),
        "bool" => "a boolean".into(),
        other => other.into(),
    }
}

/// serde_json's `invalid type: string "x", expected f64` as `expected a number, found string
/// "x"`; other messages as they are.
fn serde_in_words(msg: &str) -> String {
    let msg = msg.split(" at line ").next().unwrap_or(msg);
    for head in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = msg.strip_prefix(head)
            && let Some((found, expected)) = rest.rsplit_once(", expected ")
        {
            return format!("expected {}, found {found}", in_words(expected));
        }
    }
    msg.to_string()
}

/// The config flattened to `key.path -> value` (leaves only), for diffs, filters and params.
pub fn flatten(cfg: &Value) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    fn walk(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
        match v {
            Value::Object(map) if !map.is_empty() => {
                for (k, child) in map {
                    let path = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&path, child, out);
                }
            }
            other => {
                out.insert(prefix.to_string(), other.clone());
            }
        }
    }
    walk("", cfg, &mut out);
    out
}

/// The configuration reference (docs/config.md): every key of every group with its default,
/// generated from the config structs' defaults so it cannot drift from them.
pub fn reference_markdown() -> String {
    let value = groups::with_optional_keys(|| {
        serde_json::to_value(ExperimentConfig::default()).unwrap_or(Value::Null)
    });
    let mut out = String::from(
        "# Configuration reference\n\n\
         Generated by `harness config reference` from the config structs' defaults; \
         `rl-harness/tests/cli.rs` fails when this file and the code disagree. Every key can be \
         set in the experiment's TOML file, by an environment variable \
         (`RL_TRAINER__SEED=7` sets `trainer.seed`) or on the command line \
         (`trainer.seed=7`); `harness config show FILE` prints the resolved config. The \
         meaning is the first sentence of the doc comment on the key's field in the code (the \
         rest is there, `cargo doc --open`), under verl's names where verl has the key.\n",
    );
    let docs = docs::KeyDocs::load();
    fn table(prefix: &str, v: &Value, out: &mut String, docs: &docs::KeyDocs) {
        let Value::Object(map) = v else { return };
        let leaves: Vec<(&String, &Value)> = map
            .iter()
            .filter(|(_, c)| !matches!(c, Value::Object(m) if !m.is_empty()))
            .collect();
        if !leaves.is_empty() {
            out.push_str(&format!(
                "\n## `[{prefix}]`\n\n| key | default | meaning |\n| --- | --- | --- |\n"
            ));
            for (k, c) in leaves {
                let shown = match c {
                    Value::Null => "unset".to_string(),
                    Value::Object(_) => "{}".to_string(),
                    other => format!("`{other}`"),
                };
                let key = format!("{prefix}.{k}");
                let meaning = docs
                    .doc(&key)
                    .map(|d| d.replace('|', "\\|"))
                    .unwrap_or_default();
                out.push_str(&format!("| `{key}` | {shown} | {meaning} |\n"));
            }
        }
        for (k, c) in map {
            if matches!(c, Value::Object(m) if !m.is_empty()) {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                table(&path, c, out, docs);
            }
        }
    }
    if let Value::Object(groups) = &value {
        for (k, v) in groups {
            table(k, v, &mut out, &docs);
        }
    }
    out
}

/// The resolved config as TOML text (absent optional keys are left out).
pub fn to_toml(cfg: &ExperimentConfig) -> Result<String> {
    toml::to_string(cfg).context("serialising the resolved config as TOML")
}

/// The resolved config as JSON (the form stored in the run store).
pub fn to_json(cfg: &ExperimentConfig) -> Result<String> {
    serde_json::to_string(cfg).context("serialising the resolved config as JSON")
}

/// Keys whose values differ between two configs (`key`, old, new).
pub fn diff(old: &ExperimentConfig, new: &ExperimentConfig) -> Vec<(String, Value, Value)> {
    let a = flatten(&serde_json::to_value(old).unwrap_or(Value::Null));
    let b = flatten(&serde_json::to_value(new).unwrap_or(Value::Null));
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| {
            let (x, y) = (
                a.get(k).cloned().unwrap_or(Value::Null),
                b.get(k).cloned().unwrap_or(Value::Null),
            );
            (x != y).then(|| (k.clone(), x, y))
        })
        .collect()
}

/// Reads a TOML experiment file's text for storing next to the run.
pub fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading config file {}", path.display()))
}

pub mod checks;
mod docs;
pub mod from_verl;
pub mod groups;
mod omegaconf;
mod shell;
pub mod verl;
mod verl_sft;

#[cfg(test)]
mod tests;
