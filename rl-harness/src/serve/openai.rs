//! The OpenAI request bodies `harness serve` takes (`/v1/completions`, `/v1/chat/completions`),
//! with vLLM's extensions for training on what was sampled (`top_k`, `stop_token_ids`,
//! `return_token_ids`, `return_tokens_as_token_ids`, `ignore_eos`), checked into one
//! [`Generation`]; every error names the field at fault, and a field that would change the
//! output in a way this server does not (penalties, `logit_bias`, `echo`, tools, alternatives
//! in `logprobs`) is refused rather than ignored.

use rl_data::{Message, Tokenizer};
use rl_workers::engine::SamplingParams;
use serde::Deserialize;
use serde_json::{Map, Value};

/// A checked request: what to generate and how to answer.
#[derive(Debug, Clone)]
pub(crate) struct Generation {
    /// The prompts' token ids (chat: one, the rendered conversation).
    pub prompts: Vec<Vec<i64>>,
    /// Samples per prompt.
    pub n: usize,
    /// The sampling settings (seed and stream are set per sample).
    pub params: SamplingParams,
    /// Stop strings: the text ends before the first one.
    pub stop: Vec<String>,
    /// Return each token's log-prob.
    pub logprobs: bool,
    pub stream: bool,
    /// vLLM's `return_token_ids`: the prompt's and the completion's token ids in each choice.
    pub return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: log-prob tokens as `token_id:N`.
    pub tokens_as_ids: bool,
    /// Ours: sample `j` draws from stream `stream_offset + j` of the seed (default 0), so a
    /// trainer sending one request a prompt gets its in-process rollout's rows exactly.
    pub stream_offset: u64,
}

/// Fields the body may carry: parsed below, or accepted with no effect on the output.
#[derive(Debug, Deserialize)]
struct Body {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    n: Option<i64>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    stop_token_ids: Option<Vec<i64>>,
    #[serde(default)]
    seed: Option<serde_json::Number>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    top_logprobs: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    return_token_ids: Option<bool>,
    #[serde(default)]
    return_tokens_as_token_ids: Option<bool>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    stream_offset: Option<u64>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// Fields accepted and ignored: they do not change what is generated.
const IGNORED: &[&str] = &[
    "user",
    "stream_options",
    "metadata",
    "store",
    "service_tier",
];

/// Which endpoint a body came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Completions,
    Chat,
}

/// The model's own limits and stop tokens.
#[derive(Debug, Clone)]
pub(crate) struct ModelInfo {
    pub name: String,
    /// The folder served (SGLang's `/get_model_info` `model_path`).
    pub path: String,
    pub vocab: i64,
    pub max_len: i64,
    pub eos: Vec<i64>,
}

/// Parses and checks a request body.
pub(crate) fn parse(
    body: &[u8],
    endpoint: Endpoint,
    model: &ModelInfo,
    tokenizer: &Tokenizer,
) -> Result<Generation, String> {
    let b: Body = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not a valid request: {e}"))?;
    if let Some(name) = &b.model
        && name != &model.name
    {
        return Err(format!(
            "`model`: this server serves {:?}, not {name:?}",
            model.name
        ));
    }
    refuse_unsupported(&b.rest)?;
    let prompts = match endpoint {
        Endpoint::Completions => {
            if b.messages.is_some() {
                return Err(
                    "`messages` belongs to /v1/chat/completions; send `prompt` here".into(),
                );
            }
            completion_prompts(b.prompt.as_ref(), tokenizer)?
        }
        Endpoint::Chat => {
            if b.prompt.is_some() {
                return Err("`prompt` belongs to /v1/completions; send `messages` here".into());
            }
            let messages = b.messages.as_deref().unwrap_or_default();
            if messages.is_empty() {
                return Err("`messages`: needs at least one message".into());
            }
            let text = tokenizer
                .apply_chat_template(messages, true)
                .map_err(|e| format!("`messages`: {e}"))?;
            let ids = tokenizer
                .encode(&text, false)
                .map_err(|e| format!("`messages`: {e}"))?;
            vec![ids.into_iter().map(i64::from).collect()]
        }
    };
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(format!("`prompt`[{i}] is empty"));
        }
        if let Some(&t) = p.iter().find(|&&t| !(0..model.vocab).contains(&t)) {
            return Err(format!(
                "`prompt`[{i}]: token id {t} is outside the vocabulary 0..{}",
                model.vocab
            ));
        }
        if p.len() as i64 >= model.max_len {
            return Err(format!(
                "`prompt`[{i}]: {} tokens leave no room under the model's {} positions",
                p.len(),
                model.max_len
            ));
        }
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) as i64;
    let room = model.max_len - longest;
    let max_tokens = match (b.max_completion_tokens.or(b.max_tokens), endpoint) {
        (Some(m), _) if m < 1 => return Err(format!("`max_tokens`: must be at least 1, got {m}")),
        (Some(m), _) if m > room => {
            return Err(format!(
                "`max_tokens`: {m} with a {longest}-token prompt exceeds the model's {} positions",
                model.max_len
            ));
        }
        (Some(m), _) => m,
        // OpenAI's default for completions; chat runs to the end of the context
        (None, Endpoint::Completions) => 16.min(room),
        (None, Endpoint::Chat) => room,
    };
    let n = match b.n {
        None => 1,
        Some(n) if (1..=128).contains(&n) => n as usize,
        Some(n) => return Err(format!("`n`: must be in 1..=128, got {n}")),
    };
    let temperature = b.temperature.unwrap_or(1.0);
    let top_k = match b.top_k {
        None | Some(0) => -1,
        Some(k) => k,
    };
    let mut stop_token_ids = b.stop_token_ids.unwrap_or_default();
    if !b.ignore_eos.unwrap_or(false) {
        stop_token_ids.extend(&model.eos);
    }
    // any 64-bit integer: a negative one is taken as its two's complement
    let seed = match &b.seed {
        Some(s) => match (s.as_u64(), s.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => return Err(format!("`seed`: an integer, got {s}")),
        },
        None => rand::random(),
    };
    let params = SamplingParams {
        max_tokens,
        temperature,
        top_k,
        top_p: b.top_p.unwrap_or(1.0),
        seed,
        stream: 0,
        stop_token_ids,
    };
    params.validate().map_err(|e| format!("{e}"))?;
    let stop = match b.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("`stop`: each entry must be a string, got {s}"))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(format!(
                "`stop`: a string or a list of strings, got {other}"
            ));
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err("`stop`: an empty stop string would stop at once".into());
    }
    let logprobs = match (endpoint, &b.logprobs) {
        (_, None | Some(Value::Null)) => false,
        (Endpoint::Chat, Some(Value::Bool(v))) => *v,
        (Endpoint::Completions, Some(Value::Number(k))) => match k.as_i64() {
            Some(0 | 1) => true,
            _ => {
                return Err(format!(
                    "`logprobs`: {k} alternatives asked for; this server returns the sampled token's log-prob only (0 or 1)"
                ));
            }
        },
        (Endpoint::Chat, Some(v)) => return Err(format!("`logprobs`: true or false, got {v}")),
        (Endpoint::Completions, Some(v)) => return Err(format!("`logprobs`: 0 or 1, got {v}")),
    };
    if let Some(k) = b.top_logprobs.filter(|&k| k != 0) {
        return Err(format!(
            "`top_logprobs`: {k} alternatives asked for; this server returns the sampled token's log-prob only (0)"
        ));
    }
    Ok(Generation {
        prompts,
        n,
        params,
        stop,
        logprobs,
        stream: b.stream.unwrap_or(false),
        return_token_ids: b.return_token_ids.unwrap_or(false),
        tokens_as_ids: b.return_tokens_as_token_ids.unwrap_or(false),
        stream_offset: b.stream_offset.unwrap_or(0),
    })
}

/// Refuses a field that would change the output where this server would not honour it.
fn refuse_unsupported(rest: &Map<String, Value>) -> Result<(), String> {
    for (key, v) in rest {
        if IGNORED.contains(&key.as_str()) || v.is_null() {
            continue;
        }
        let neutral = match key.as_str() {
            "presence_penalty" | "frequency_penalty" => v.as_f64() == Some(0.0),
            "repetition_penalty" => v.as_f64() == Some(1.0),
            "echo" => v.as_bool() == Some(false),
            "best_of" => v.as_i64() == Some(1),
            "logit_bias" => v.as_object().is_some_and(Map::is_empty),
            "tools" | "functions" => v.as_array().is_some_and(Vec::is_empty),
            "tool_choice" | "function_call" => v.as_str() == Some("none"),
            "parallel_tool_calls" => v.is_boolean(),
            _ => false,
        };
        if !neutral {
            return Err(format!("`{key}` is not supported by this server (got {v})"));
        }
    }
    Ok(())
}

/// `prompt`: a string, a list of token ids, a list of strings or a list of token-id lists.
fn completion_prompts(
    prompt: Option<&Value>,
    tokenizer: &Tokenizer,
) -> Result<Vec<Vec<i64>>, String> {
    let encode = |s: &str| -> Result<Vec<i64>, String> {
        Ok(tokenizer
            .encode(s, true)
            .map_err(|e| format!("`prompt`: {e}"))?
            .into_iter()
            .map(i64::from)
            .collect())
    };
    let ids = |a: &[Value]| -> Option<Vec<i64>> { a.iter().map(Value::as_i64).collect() };
    match prompt {
        None => Err("missing `prompt`".into()),
        Some(Value::String(s)) => Ok(vec![encode(s)?]),
        Some(Value::Array(a)) if a.is_empty() => Err("`prompt`: an empty list".into()),
        Some(Value::Array(a)) if a[0].is_number() => ids(a)
            .map(|p| vec![p])
            .ok_or_else(|| "`prompt`: a list of token ids must hold integers only".into()),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Value::String(s) => encode(s),
                Value::Array(t) => ids(t).ok_or_else(|| {
                    format!("`prompt`[{i}]: a list of token ids must hold integers only")
                }),
                other => Err(format!(
                    "`prompt`[{i}]: a string or a list of token ids, got {other}"
                )),
            })
            .collect(),
        Some(other) => Err(format!(
            "`prompt`: a string, a list of token ids or a list of either, got {other}"
        )),
    }
}
