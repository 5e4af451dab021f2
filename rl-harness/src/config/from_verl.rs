//! `harness config from-verl`: a verl run (a `main_ppo` command line, a script that runs one,
//! or its YAML config, resolved as verl prints it or as Hydra saves it with OmegaConf's
//! interpolations, which are resolved here) as this harness's TOML, saying what it mapped, what
//! has no effect here and what it refused. verl's SFT trainer's config is renamed to this
//! harness's keys first ([`super::verl_sft`]).

use anyhow::{Context, Result, bail};

use super::shell::Arg;
pub use super::shell::Env as ShellEnv;
use super::{Override, Sources, known_keys, layered, load, verl};
use crate::suggest::nearest_key;

/// What became of each verl key.
#[derive(Debug, Default)]
pub struct Translation {
    /// The TOML: every mapped key (and `trainer.algorithm` from the entry point).
    pub toml: String,
    /// `key = value` set here as given (or mapped: `trainer.logger`).
    pub mapped: Vec<String>,
    /// `key: why` for verl keys with no effect here, left out.
    pub ignored: Vec<String>,
    /// `key: why` for keys this harness does not have, left out.
    pub refused: Vec<String>,
    /// What the full checks say of the result (a model named by its hub id, not a local
    /// folder; batch sizes that do not divide), if anything.
    pub unchecked: Option<String>,
}

/// Keys verl's config fills in from others when a command line leaves them out.
const INTERPOLATED: &[(&str, &str)] = &[
    (
        "critic.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
    ),
    ("critic.ppo_epochs", "actor_rollout_ref.actor.ppo_epochs"),
    (
        "critic.use_dynamic_bsz",
        "actor_rollout_ref.actor.use_dynamic_bsz",
    ),
];

/// verl's entry points and the trainer each maps to.
const ENTRY_POINTS: &[(&str, &str)] = &[
    ("verl.trainer.main_ppo", "on_policy"),
    ("recipe.dapo.main_dapo", "on_policy"),
    ("verl.trainer.fsdp_sft_trainer", "sft"),
    // verl's engine SFT trainer (conversations); "sft" once its keys are renamed
    ("verl.trainer.sft_trainer", "sft_engine"),
    ("recipe.spin.main_spin", "spin"),
];

/// `key.path` -> the value as written.
pub(super) type Pairs = Vec<(String, String)>;

/// The value `pairs` give `key` last, as written.
pub(super) fn last<'a>(pairs: &'a Pairs, key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Translates `text`: verl's resolved YAML config when `yaml`, else a command line or a script
/// (read as bash runs it, with `env`'s environment, directory and arguments).
pub fn translate(text: &str, yaml: bool, env: ShellEnv<'_>) -> Result<Translation> {
    let mut t = Translation::default();
    let mut expanded = std::collections::BTreeMap::new();
    let (entry, pairs) = if yaml {
        let (pairs, unresolved) = yaml_pairs(text)?;
        for (key, why) in unresolved {
            t.refused.push(format!(
                "{key}: an interpolation not resolved here ({why}); set it in the TOML by hand"
            ));
        }
        (None, pairs)
    } else {
        let c = command_line_pairs(text, env)?;
        t.refused.extend(c.refused);
        expanded = c.expanded;
        (Some(c.entry), c.pairs)
    };
    // verl's SFT trainer lays out its config unlike the RL trainer: renamed to ours first
    use super::verl_sft::SftTrainer;
    let sft = match entry {
        Some("sft") => Some(SftTrainer::Legacy),
        Some("sft_engine") => Some(SftTrainer::Engine),
        Some(_) => None,
        None => super::verl_sft::sft_config_kind(&pairs),
    };
    let sft_yaml = entry.is_none() && sft.is_some();
    let mut origins = std::collections::BTreeMap::new();
    let (entry, pairs) = if let Some(kind) = sft {
        let k = super::verl_sft::to_harness_keys(kind, &pairs);
        t.ignored.extend(k.ignored);
        t.refused.extend(k.refused);
        origins = k.notes;
        (Some("sft"), k.pairs)
    } else {
        (entry, pairs)
    };
    let known = known_keys();
    let disabled = disabled_tables(&pairs);
    let mut overrides: Vec<Override> = Vec::new();
    if let Some(kind) = entry
        && !pairs.iter().any(|(k, _)| k == "trainer.algorithm")
    {
        overrides.push(Override::set(
            "trainer.algorithm",
            toml::Value::String(kind.into()),
        ));
        let why = if sft_yaml {
            "verl's SFT trainer config"
        } else {
            "the entry point"
        };
        t.mapped
            .push(format!("trainer.algorithm = \"{kind}\" ({why})"));
    }
    for (key, raw) in &pairs {
        let o = Override::parse(&format!("{key}={raw}"))?;
        if raw.contains('$') {
            // what bash passes on: a `${...}` in single quotes is OmegaConf's
            t.refused.push(format!(
                "{}: `{raw}` holds `$`, an OmegaConf interpolation on verl's command line, \
                 resolved here only in a YAML config; set the value in the TOML by hand",
                o.key
            ));
            continue;
        }
        let alias = verl::alias(&o.key).filter(|k| super::is_config_key(k, &known));
        if super::is_config_key(&o.key, &known) || o.key == "trainer.logger" || alias.is_some() {
            // each on its own, so that one bad value names itself
            let mut notes = Vec::new();
            let checked = super::foreign_override(&o, &known, &mut notes).and_then(|os| {
                layered(&Sources {
                    file: None,
                    env: false,
                    overrides: overrides.iter().chain(&os).cloned().collect(),
                })
                .map(|_| os)
            });
            match checked {
                Ok(os) => {
                    let verls = alias.as_ref().map(|_| format!("verl's {}", o.key));
                    let from = [verls.as_ref(), origins.get(&o.key), expanded.get(&o.key)]
                        .into_iter()
                        .flatten()
                        .map(|n| format!(" ({n})"))
                        .collect::<String>();
                    let key = alias.as_deref().unwrap_or(&o.key);
                    t.mapped.push(format!("{key} = {}{from}", o.value_text()));
                    overrides.extend(os);
                }
                Err(e) => t
                    .refused
                    .push(format!("{}: {}", o.key, crate::console::one_line(&e))),
            }
            continue;
        }
        match foreign_verdict(&o, &pairs, &disabled) {
            Verdict::NoEffect(why) => t.ignored.push(format!("{}: {why}", o.key)),
            Verdict::Refused(why) => t.refused.push(format!("{}: {why}", o.key)),
            Verdict::Unknown => {
                let hint = nearest_key(&o.key, &known)
                    .map(|n| format!(" (the nearest key here: `{n}`)"))
                    .unwrap_or_default();
                t.refused
                    .push(format!("{}: not a key of this harness{hint}", o.key));
            }
        }
    }
    // what verl's config fills in from other keys (`${oc.select:...}`) when not given
    for (key, from) in INTERPOLATED.iter().filter(|_| entry != Some("sft")) {
        if overrides.iter().any(|o| o.key == *key) {
            continue;
        }
        if let Some(v) = overrides.iter().rev().find(|o| o.key == *from).cloned() {
            t.mapped.push(format!(
                "{key} = {} (from {from}, as verl's config fills it)",
                v.value_text()
            ));
            overrides.push(Override {
                key: key.to_string(),
                value: v.value,
            });
        }
    }
    t.unchecked = load(&Sources {
        file: None,
        env: false,
        overrides: overrides.clone(),
    })
    .err()
    .map(|e| crate::console::one_line(&e));
    t.toml = to_toml(&overrides)?;
    Ok(t)
}

/// The overrides as a nested TOML document (the later of two settings of a key wins).
fn to_toml(overrides: &[Override]) -> Result<String> {
    let mut root = toml::Table::new();
    for o in overrides {
        let Some(value) = &o.value else { continue };
        let mut parts: Vec<&str> = o.key.split('.').collect();
        let leaf = parts.pop().context("an empty key")?;
        let mut table = &mut root;
        for p in parts {
            let entry = table
                .entry(p)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = match entry {
                toml::Value::Table(t) => t,
                _ => bail!("`{}` is both a value and a group", o.key),
            };
        }
        table.insert(leaf.to_string(), value.clone());
    }
    Ok(toml::to_string(&root)?)
}

/// A verl command line or script's keys.
struct CommandLine {
    /// The trainer its entry point maps to.
    entry: &'static str,
    pairs: Pairs,
    /// `key: why` for arguments that could not be read, and the command's own condition.
    refused: Vec<String>,
    /// key -> `from `word`` where the value came out of the script's variables.
    expanded: std::collections::BTreeMap<String, String>,
}

/// The `key=value` arguments of the verl command a command line or script runs, expanded as
/// bash passes them ([`super::shell`]), and the trainer its entry point maps to.
fn command_line_pairs(text: &str, env: ShellEnv<'_>) -> Result<CommandLine> {
    let is_entry =
        |w: &str| ENTRY_POINTS.iter().any(|(e, _)| w == *e) || w.ends_with("main_ppo.py");
    let Some(launch) = super::shell::launch(text, env, &is_entry)? else {
        bail!(
            "no verl entry point in it (looked for {}); give a `python3 -m \
             verl.trainer.main_ppo key=value ...` command line, or its resolved YAML config \
             (.yaml)",
            ENTRY_POINTS
                .iter()
                .map(|(e, _)| *e)
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    let entry = ENTRY_POINTS
        .iter()
        .find(|(e, _)| *e == launch.entry)
        .map_or("on_policy", |(_, k)| *k);
    let mut c = CommandLine {
        entry,
        pairs: Vec::new(),
        refused: Vec::new(),
        expanded: Default::default(),
    };
    if let Some((line, word)) = launch.cut {
        c.refused.push(format!(
            "(the verl command): it ends a line before line {line}, where `{word}` starts a \
             command of its own (a `\\` followed by blanks or a comment ends a command in bash): \
             the keys from there on are not verl's; end each line of the command with `\\` alone"
        ));
    }
    if let Some(why) = launch.conditional {
        c.refused.push(format!(
            "(the verl command): it runs only {why}; its keys are read as if it runs"
        ));
    }
    for arg in launch.args {
        match arg {
            Arg::Text { text, from } => {
                if let Some((k, v)) = config_pair(&text) {
                    if let Some(word) = from {
                        c.expanded.insert(k.clone(), format!("from `{word}`"));
                    }
                    c.pairs.push((k, v));
                }
            }
            Arg::Unread { raw, why } => {
                let unquoted: String = raw.chars().filter(|c| !matches!(c, '"' | '\'')).collect();
                c.refused.push(match config_pair(&unquoted).filter(|(k, _)| !k.contains('$')) {
                    Some((k, _)) => format!("{k}: `{raw}`: {why}; set it in the TOML by hand"),
                    None => format!(
                        "`{raw}`: {why}; the keys it holds are left out (set them in the TOML by hand)"
                    ),
                });
            }
        }
    }
    Ok(c)
}

/// A `key=value` argument of a config key (dotted, or one of the SFT trainer's top-level ones;
/// Hydra's `+`/`++` dropped): (key, value as written). Options (`--config-path=...`) are not.
fn config_pair(arg: &str) -> Option<(String, String)> {
    let (k, v) = arg.split_once('=')?;
    let k = k.trim_start_matches('+');
    let key_like = !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit() || c == '.')
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    key_like.then(|| (k.to_string(), v.to_string()))
}

/// verl's YAML config (resolved as verl prints it, or as Hydra saves it with OmegaConf's
/// interpolations, which are resolved here) flattened to `key.path` -> the value as a command
/// line writes it; and the keys whose interpolation was left as written, with why.
fn yaml_pairs(text: &str) -> Result<(Pairs, Vec<(String, String)>)> {
    let mut doc: serde_json::Value =
        serde_norway::from_str(text).context("parsing the YAML config")?;
    let unresolved = super::omegaconf::resolve(&mut doc);
    let pairs = super::flatten(&doc)
        .into_iter()
        .filter(|(k, _)| !unresolved.contains_key(k))
        .filter_map(|(k, v)| match v {
            // unset in verl: this harness's default stands
            serde_json::Value::Null => None,
            serde_json::Value::String(s) => Some((k, format!("'{}'", s.replace('\'', "")))),
            other => Some((k, other.to_string())),
        })
        .collect();
    Ok((pairs, unresolved.into_iter().collect()))
}

/// What becomes of a verl key this harness does not have.
enum Verdict {
    /// It has no effect here, for this reason.
    NoEffect(String),
    /// It asks for something this harness does not do, for this reason.
    Refused(String),
    /// No key of verl's this translation knows.
    Unknown,
}

/// The [`Verdict`] on `o`, a key this harness does not have, given the config's other `pairs`
/// and the tables it switches off.
fn foreign_verdict(o: &Override, pairs: &Pairs, disabled: &[String]) -> Verdict {
    if let Some(verdict) = verl::one_value(&o.key, o.value.as_ref()) {
        return match verdict {
            Ok(why) => Verdict::NoEffect(why.to_owned()),
            Err(why) => Verdict::Refused(why),
        };
    }
    if o.key == "reward_model.reward_kwargs.max_resp_len" {
        // verl's DAPO manager measures the overlong penalty against it; here the run's
        // maximum response length is that measure
        let max = last(pairs, "data.max_response_length")
            .and_then(verl::parse_value)
            .and_then(|v| v.as_integer())
            .unwrap_or(rl_data::DataConfig::default().max_response_length as i64);
        let given = o.value.as_ref().and_then(|v| v.as_integer());
        return if given == Some(max) {
            Verdict::NoEffect(format!(
                "the overlong penalty is measured against data.max_response_length ({max}), the same"
            ))
        } else {
            Verdict::Refused(format!(
                "`{}` differs from data.max_response_length ({max}), which the overlong penalty \
                 is measured against here: make them one",
                o.value_text()
            ))
        };
    }
    if let Some(group) = o.key.strip_suffix(".optim.clip_grad") {
        // verl's newer workers clip by the optimiser's `clip_grad`, its older ones by the
        // group's `grad_clip`: this harness has the latter, so the two must agree
        let clip_key = format!("{group}.grad_clip");
        let clip = last(pairs, &clip_key).and_then(verl::parse_value);
        let as_f64 = |v: Option<&toml::Value>| match v {
            Some(toml::Value::Float(f)) => Some(*f),
            Some(toml::Value::Integer(i)) => Some(*i as f64),
            _ => None,
        };
        let (given, clip) = (
            as_f64(o.value.as_ref()),
            as_f64(clip.as_ref()).unwrap_or(1.0),
        );
        return if given == Some(clip) {
            Verdict::NoEffect(format!("the clip here is `{clip_key}` ({clip}), the same"))
        } else {
            Verdict::Refused(format!(
                "`{}` differs from `{clip_key}` ({clip}), the clip here: set that key to the clip meant",
                o.value_text()
            ))
        };
    }
    match verl::foreign(&o.key) {
        Some(verl::Foreign::NoEffect(why)) => Verdict::NoEffect(why.to_owned()),
        None => inert(&o.key, &o.value, disabled).map_or(Verdict::Unknown, Verdict::NoEffect),
    }
}

/// The tables a verl config switches off (`X.enable = false`, `X.enabled = false`, or `use_X =
/// false` beside `X`): every other key under `X` then asks for nothing.
fn disabled_tables(pairs: &Pairs) -> Vec<String> {
    pairs
        .iter()
        .filter(|(_, raw)| matches!(verl::parse_value(raw), Some(toml::Value::Boolean(false))))
        .filter_map(|(k, _)| {
            if let Some(t) = k
                .strip_suffix(".enable")
                .or_else(|| k.strip_suffix(".enabled"))
            {
                return Some(t.to_owned());
            }
            let (parent, last) = k.rsplit_once('.').unwrap_or(("", k));
            let table = last.strip_prefix("use_")?;
            Some(if parent.is_empty() {
                table.to_owned()
            } else {
                format!("{parent}.{table}")
            })
        })
        .collect()
}

/// Why a verl key this harness does not have asks for nothing, where it does not: Hydra's
/// `_target_` (the class a table instantiates), verl's profiler, a key under a table the config
/// switches off, or a value that switches nothing on (false, or empty).
fn inert(key: &str, value: &Option<toml::Value>, disabled: &[String]) -> Option<String> {
    if key == "_target_" || key.ends_with("._target_") {
        return Some("Hydra's class to instantiate the table with, not a setting".into());
    }
    if key == "defaults" {
        return Some(
            "Hydra's defaults list (the files the config is composed of), not a setting".into(),
        );
    }
    if key.starts_with("global_profiler.") || key.contains(".profiler.") {
        return Some(
            "verl's profiler (nsys, torch, npu): profiling changes no result; profile here with \
             `perf` or `scripts/bench`"
                .into(),
        );
    }
    if let Some(table) = disabled.iter().find(|t| {
        key.strip_prefix(t.as_str())
            .is_some_and(|r| r.starts_with('.'))
    }) {
        return Some(format!("under `{table}`, which the config switches off"));
    }
    let off = match value {
        None => true,
        Some(toml::Value::Boolean(b)) => !b,
        Some(toml::Value::String(s)) => s.is_empty(),
        Some(toml::Value::Array(a)) => a.is_empty(),
        Some(toml::Value::Table(t)) => t.is_empty(),
        Some(_) => false,
    };
    off.then(|| "false, null or empty in the config: it switches nothing on".into())
}
