//! Hugging Face tokenizers from `tokenizer.json` and chat templates rendered with minijinja.
//!
//! [`Tokenizer::from_dir`] reads a model directory the way `AutoTokenizer.from_pretrained` does
//! for a fast tokenizer: `tokenizer.json` for the model, `tokenizer_config.json` (then
//! `special_tokens_map.json`) for the bos/eos/pad/unk tokens, and the chat template from
//! `tokenizer_config.json`'s `chat_template` (a string, or a list of `{name, template}` of which
//! `default` is used) or a `chat_template.jinja` file beside it.
//!
//! [`ChatTemplate`] renders like transformers' `apply_chat_template(tokenize=False)`: a Jinja
//! environment with `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`,
//! `strftime_now`, a `tojson` filter that writes what Python's `json.dumps(ensure_ascii=False)`
//! writes, Python string methods (`.strip()`, `.startswith()`, ...), and the variables
//! `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `pad_token`, `unk_token`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

mod fast;

/// A value handed to a chat template (minijinja's dynamic value; maps keep their key order,
/// so `tools | tojson` writes keys in the order the JSON had them, as Python does).
pub type TemplateValue = Value;

/// One chat message: `{"role": ..., "content": ...}` plus any other keys (`tool_calls`, `name`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message text.
    pub content: String,
    /// Any further keys, passed to the template as they are.
    #[serde(flatten, default)]
    pub extra: BTreeMap<String, TemplateValue>,
}

impl Message {
    /// A message with just a role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            extra: BTreeMap::new(),
        }
    }
    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// The special tokens a template may refer to, as strings (`None` = not set, undefined in Jinja).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token`.
    pub bos: Option<String>,
    /// `eos_token`.
    pub eos: Option<String>,
    /// `pad_token`.
    pub pad: Option<String>,
    /// `unk_token`.
    pub unk: Option<String>,
}

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    special: SpecialTokens,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("special", &self.special)
            .finish()
    }
}

const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles a Jinja chat template; `special` fills `bos_token`, `eos_token`, ... at render.
    pub fn new(source: impl Into<String>, special: SpecialTokens) -> Result<Self> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| Error::ChatTemplate(e.to_string()))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| Error::ChatTemplate(format!("parse: {e:#}")))?;
        Ok(Self {
            env,
            source,
            special,
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` as `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=...)` does.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &BTreeMap::new())
    }

    /// Like [`render`](Self::render), with extra template variables (`tools`,
    /// `enable_thinking`, ...: verl's `apply_chat_template_kwargs`).
    pub fn render_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        kwargs: &BTreeMap<String, TemplateValue>,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| Error::ChatTemplate(e.to_string()))?;
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        for (k, v) in [
            ("bos_token", &self.special.bos),
            ("eos_token", &self.special.eos),
            ("pad_token", &self.special.pad),
            ("unk_token", &self.special.unk),
        ] {
            if let Some(v) = v {
                ctx.insert(k, Value::from(v.as_str()));
            }
        }
        for (k, v) in kwargs {
            ctx.insert(k.as_str(), v.clone());
        }
        ctx.insert("messages", Value::from(minijinja::value::Serde(messages)));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        tmpl.render(Value::from_pairs(ctx))
            .map_err(|e| Error::ChatTemplate(render_error_message(&e)))
    }
}

fn render_error_message(e: &minijinja::Error) -> String {
    if e.kind() == ErrorKind::InvalidOperation
        && let Some(detail) = e.detail()
    {
        return detail.to_string();
    }
    format!("{e:#}")
}

/// `raise_exception(msg)`, as transformers defines it: the template aborts with `msg`.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("raise_exception: {msg}"),
    ))
}

/// `strftime_now(fmt)`: the current UTC date/time formatted with the common strftime codes.
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(secs, &fmt)
}

/// Formats Unix time `secs` (UTC) with `%d %m %Y %y %b %B %a %A %H %M %S %j %%`.
fn strftime(secs: i64, fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson` as transformers registers it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match &separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ));
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    py_json(&value, &opts, 0, &mut out)?;
    // Mark safe so nothing escapes it, as in transformers (autoescape is off there anyway).
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<usize>,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

fn py_json(
    v: &Value,
    opts: &JsonOpts,
    level: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = opts.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64().filter(|_| v.is_integer()) {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            out.push_str(&serde_json::to_string(s).unwrap_or_default());
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, level + 1);
                py_json(item, opts, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if opts.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, level + 1);
                let ks = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                out.push_str(&serde_json::to_string(&ks).unwrap_or_default());
                out.push_str(&opts.key_sep);
                py_json(&v.get_item(k)?, opts, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        _ => out.push_str(&serde_json::to_string(&v.to_string()).unwrap_or_default()),
    }
    Ok(())
}

/// Python's `repr(float)` for the values that show up in templates.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        }
    } else if f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

/// A Hugging Face fast tokenizer with its special tokens and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
    chat_template: Option<ChatTemplate>,
    named_templates: BTreeMap<String, String>,
    clean_up_tokenization_spaces: bool,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    segmenter: Option<Segmenter>,
    /// Byte-level BPE without the tokenizers crate's pipeline, for ASCII pieces between added
    /// tokens (only with a segmenter).
    fast: Option<fast::AsciiByteLevel>,
    /// The `tokenizer_config.json` read, or where it was looked for (`None` beside it: absent).
    config_file: (PathBuf, bool),
}

/// What one encoding call (or one thread of a batch) has already encoded: pieces between added
/// tokens and, for the byte-level shortcut, words; both keyed by slices of the input texts.
#[derive(Default)]
struct EncodeCache<'a> {
    pieces: std::collections::HashMap<&'a str, Vec<u32>>,
    words: fast::WordCache<'a>,
}

/// Splits text at added tokens the way `tokenizers` does before it pre-tokenises, so the pieces
/// between added tokens can be encoded on their own (and repeated pieces, such as a template's
/// system prompt, encoded once per batch). Only built when that is exact: every added token is
/// un-normalised with no strip or single-word rule, and tokenizer.json sets no truncation or
/// padding.
#[derive(Clone)]
struct Segmenter {
    /// The added tokens, longest first (leftmost-longest, as tokenizers' matcher).
    re: regex::Regex,
    ids: std::collections::HashMap<String, u32>,
}

impl Segmenter {
    fn new(inner: &tokenizers::Tokenizer) -> Option<Self> {
        if inner.get_truncation().is_some() || inner.get_padding().is_some() {
            return None;
        }
        let added = inner.get_added_tokens_decoder();
        if added.is_empty()
            || added
                .values()
                .any(|t| t.normalized || t.lstrip || t.rstrip || t.single_word)
        {
            return None;
        }
        let mut tokens: Vec<(&String, u32)> =
            added.iter().map(|(id, t)| (&t.content, *id)).collect();
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(b.0)));
        let pattern = tokens
            .iter()
            .map(|(c, _)| regex::escape(c))
            .collect::<Vec<_>>()
            .join("|");
        let re = regex::Regex::new(&pattern).ok()?;
        let ids = tokens.into_iter().map(|(c, id)| (c.clone(), id)).collect();
        Some(Self { re, ids })
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("special", &self.special)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| Error::Tokenizer {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// A special token in tokenizer_config.json: a string or an `AddedToken` dict with `content`.
fn token_string(path: &Path, key: &str, v: Option<&serde_json::Value>) -> Result<Option<String>> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Object(o)) => match o.get("content") {
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(Error::Tokenizer {
                path: path.to_path_buf(),
                message: format!("`{key}` is an object without a string `content`"),
            }),
        },
        Some(other) => Err(Error::Tokenizer {
            path: path.to_path_buf(),
            message: format!("`{key}` must be a string or {{\"content\": ...}}, got {other}"),
        }),
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` plus, when present, `dir/tokenizer_config.json`,
    /// `dir/special_tokens_map.json` and `dir/chat_template.jinja`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = dir.join("tokenizer_config.json");
        let config = config.exists().then_some(config);
        let mut tok = Self::from_files(dir.join("tokenizer.json"), config.as_deref())?;
        let stm = dir.join("special_tokens_map.json");
        if stm.exists() {
            let v = read_json(&stm)?;
            let fill = |slot: &mut Option<String>, key: &str| -> Result<()> {
                if slot.is_none() {
                    *slot = token_string(&stm, key, v.get(key))?;
                }
                Ok(())
            };
            fill(&mut tok.special.bos, "bos_token")?;
            fill(&mut tok.special.eos, "eos_token")?;
            fill(&mut tok.special.pad, "pad_token")?;
            fill(&mut tok.special.unk, "unk_token")?;
            tok.resolve_ids();
        }
        let jinja = dir.join("chat_template.jinja");
        if tok.chat_template.is_none() && jinja.exists() {
            let src = std::fs::read_to_string(&jinja).map_err(|source| Error::Io {
                path: jinja.clone(),
                source,
            })?;
            tok.set_chat_template(src)?;
        }
        if tok.chat_template.is_some() {
            // Rebuild so the template sees special tokens filled from special_tokens_map.json.
            let src = tok
                .chat_template
                .as_ref()
                .map(|t| t.source.clone())
                .unwrap_or_default();
            tok.set_chat_template(src)?;
        }
        Ok(tok)
    }

    /// Loads a `tokenizer.json` and an optional `tokenizer_config.json`.
    pub fn from_files(tokenizer_json: impl AsRef<Path>, config: Option<&Path>) -> Result<Self> {
        let tj = tokenizer_json.as_ref();
        if !tj.exists() {
            return Err(Error::Io {
                path: tj.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(tj).map_err(|e| Error::Tokenizer {
            path: tj.to_path_buf(),
            message: e.to_string(),
        })?;
        let mut tok = Self {
            inner,
            special: SpecialTokens::default(),
            chat_template: None,
            named_templates: BTreeMap::new(),
            clean_up_tokenization_spaces: false,
            bos_id: None,
            eos_id: None,
            pad_id: None,
            segmenter: None,
            fast: None,
            config_file: match config {
                Some(cp) => (cp.to_path_buf(), true),
                None => (tj.with_file_name("tokenizer_config.json"), false),
            },
        };
        tok.segmenter = Segmenter::new(&tok.inner);
        if tok.segmenter.is_some() {
            tok.fast = fast::AsciiByteLevel::new(&tok.inner);
        }
        if let Some(cp) = config {
            let cfg = read_json(cp)?;
            tok.special = SpecialTokens {
                bos: token_string(cp, "bos_token", cfg.get("bos_token"))?,
                eos: token_string(cp, "eos_token", cfg.get("eos_token"))?,
                pad: token_string(cp, "pad_token", cfg.get("pad_token"))?,
                unk: token_string(cp, "unk_token", cfg.get("unk_token"))?,
            };
            tok.clean_up_tokenization_spaces = cfg
                .get("clean_up_tokenization_spaces")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false);
            match cfg.get("chat_template") {
                None | Some(serde_json::Value::Null) => {}
                Some(serde_json::Value::String(s)) => {
                    tok.named_templates.insert("default".into(), s.clone());
                }
                Some(serde_json::Value::Array(list)) => {
                    for (i, item) in list.iter().enumerate() {
                        let name = item.get("name").and_then(serde_json::Value::as_str);
                        let tmpl = item.get("template").and_then(serde_json::Value::as_str);
                        match (name, tmpl) {
                            (Some(n), Some(t)) => {
                                tok.named_templates.insert(n.to_string(), t.to_string());
                            }
                            _ => {
                                return Err(Error::Tokenizer {
                                    path: cp.to_path_buf(),
                                    message: format!(
                                        "`chat_template[{i}]` needs string `name` and `template`"
                                    ),
                                });
                            }
                        }
                    }
                }
                Some(other) => {
                    return Err(Error::Tokenizer {
                        path: cp.to_path_buf(),
                        message: format!(
                            "`chat_template` must be a string or a list of {{name, template}}, got {}",
                            json_kind(other)
                        ),
                    });
                }
            }
            if let Some(src) = tok.named_templates.get("default").cloned() {
                tok.chat_template =
                    Some(ChatTemplate::new(src, tok.special.clone()).map_err(|e| {
                        Error::Tokenizer {
                            path: cp.to_path_buf(),
                            message: e.to_string(),
                        }
                    })?);
            }
        }
        tok.resolve_ids();
        Ok(tok)
    }

    fn resolve_ids(&mut self) {
        let id = |s: &Option<String>| s.as_deref().and_then(|t| self.inner.token_to_id(t));
        self.bos_id = id(&self.special.bos);
        self.eos_id = id(&self.special.eos);
        self.pad_id = id(&self.special.pad);
    }

    /// Replaces the chat template (verl's `data.apply_chat_template_kwargs.chat_template`).
    pub fn set_chat_template(&mut self, source: impl Into<String>) -> Result<()> {
        self.chat_template = Some(ChatTemplate::new(source, self.special.clone())?);
        Ok(())
    }

    /// Selects one of the named templates from a list-valued `chat_template` (`tool_use`).
    pub fn use_named_template(&mut self, name: &str) -> Result<()> {
        let src = self.named_templates.get(name).cloned().ok_or_else(|| {
            Error::ChatTemplate(format!(
                "no template named `{name}` (have: {})",
                self.named_templates
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        self.set_chat_template(src)
    }

    /// The chat template in use, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The special tokens as strings.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Vocabulary size including added tokens (`len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of `token`, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// `bos_token_id`.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// `eos_token_id`.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// `pad_token_id` as configured (no fallback).
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// The id used to pad batches: `pad_token_id`, or `eos_token_id` when there is no pad token
    /// (verl's `hf_tokenizer` sets `pad_token = eos_token` in that case), or an error.
    pub fn pad_id_or_eos(&self) -> Result<u32> {
        self.pad_id.or(self.eos_id).ok_or_else(|| {
            let (path, found) = &self.config_file;
            Error::Tokenizer {
                path: path.clone(),
                message: if *found {
                    "neither pad_token nor eos_token is set; cannot pad".into()
                } else {
                    "the file is missing (it names the pad and eos tokens), so batches cannot \
                     be padded"
                        .into()
                },
            }
        })
    }

    /// `tokenizer.encode(text, add_special_tokens=...)`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.encode_cached(
            text,
            add_special_tokens,
            self.fast.as_ref(),
            &mut EncodeCache::default(),
        )
    }

    /// The tokenizers crate's own encoding of `text`.
    fn encode_plain(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes `text`; without special tokens and with a segmenter, piece by piece between added
    /// tokens, looking pieces up in `cache` first, and ASCII pieces through `fast` (the
    /// tokenizer's byte-level shortcut or a thread's own copy of it) when there is one.
    fn encode_cached<'a>(
        &self,
        text: &'a str,
        add_special_tokens: bool,
        fast: Option<&fast::AsciiByteLevel>,
        cache: &mut EncodeCache<'a>,
    ) -> Result<Vec<u32>> {
        let seg = match &self.segmenter {
            Some(seg) if !add_special_tokens => seg,
            _ => return self.encode_plain(text, add_special_tokens),
        };
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut piece = |s: &'a str, out: &mut Vec<u32>| -> Result<()> {
            if s.is_empty() {
                return Ok(());
            }
            if let Some(ids) = cache.pieces.get(s) {
                out.extend_from_slice(ids);
                return Ok(());
            }
            let start = out.len();
            match fast {
                Some(fast) if s.is_ascii() => fast
                    .encode_into(self.inner.get_model(), s, &mut cache.words, out)
                    .map_err(|e| Error::Encode(e.to_string()))?,
                _ => out.extend(self.encode_plain(s, false)?),
            }
            // Short pieces are the ones that repeat (template text); keep the map small.
            if s.len() <= 512 && cache.pieces.len() < 4096 {
                cache.pieces.insert(s, out[start..].to_vec());
            }
            Ok(())
        };
        let mut last = 0;
        for m in seg.re.find_iter(text) {
            piece(&text[last..m.start()], &mut out)?;
            out.push(seg.ids[m.as_str()]);
            last = m.end();
        }
        piece(&text[last..], &mut out)?;
        Ok(out)
    }

    /// Encodes many texts, on up to `available_parallelism` threads, each taking one contiguous
    /// chunk. (tokenizers' own `encode_batch` uses rayon, whose idle workers spin; on a busy
    /// 2-core machine it ran at half the speed of a plain loop, while plain threads do not.)
    pub fn encode_batch(
        &self,
        texts: &[String],
        add_special_tokens: bool,
    ) -> Result<Vec<Vec<u32>>> {
        const MIN_PER_THREAD: usize = 64;
        let threads = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(texts.len() / MIN_PER_THREAD)
            .max(1);
        let serial = |chunk: &[String], fast: Option<&fast::AsciiByteLevel>| {
            let mut cache = EncodeCache::default();
            chunk
                .iter()
                .map(|t| self.encode_cached(t, add_special_tokens, fast, &mut cache))
                .collect::<Result<Vec<_>>>()
        };
        if threads == 1 {
            return serial(texts, self.fast.as_ref());
        }
        let per = texts.len().div_ceil(threads);
        let parts: Vec<Result<Vec<Vec<u32>>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = texts
                .chunks(per)
                .map(|chunk| {
                    // A copy per thread: its regexes' scratch space then belongs to that thread
                    // (a `regex::Regex` shared across threads hands it out through a lock).
                    let own = self.fast.clone();
                    scope.spawn(move || serial(chunk, own.as_ref()))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Encode("encoder thread panicked".into())))
                })
                .collect()
        });
        let mut out = Vec::with_capacity(texts.len());
        for p in parts {
            out.extend(p?);
        }
        Ok(out)
    }

    /// `tokenizer.decode(ids, skip_special_tokens=...)`, with `clean_up_tokenization_spaces`
    /// applied when tokenizer_config.json sets it.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text = self
            .inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Encode(e.to_string()))?;
        Ok(if self.clean_up_tokenization_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.chat_template
            .as_ref()
            .ok_or(Error::NoChatTemplate)?
            .render(messages, add_generation_prompt)
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a bool",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// transformers' `clean_up_tokenization`.
fn clean_up_tokenization(s: &str) -> String {
    s.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

#[cfg(test)]
mod tests;
