//! GGUF import: reads a llama.cpp GGUF file (Llama architecture), dequantises its tensors
//! (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), undoes llama.cpp's q/k RoPE permutation and
//! writes a Hugging Face directory: config.json, generation_config.json, model.safetensors,
//! tokenizer.json and tokenizer_config.json (with the chat template).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use serde_json::{Value, json};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::hf;

/// A metadata value of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// A string.
    Str(String),
    /// An array of values.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    fn as_i64(&self) -> Option<i64> {
        match self {
            GgufValue::U64(v) => i64::try_from(*v).ok(),
            GgufValue::I64(v) => Some(*v),
            _ => None,
        }
    }
    fn as_f64(&self) -> Option<f64> {
        match self {
            GgufValue::F64(v) => Some(*v),
            GgufValue::U64(v) => Some(*v as f64),
            GgufValue::I64(v) => Some(*v as f64),
            _ => None,
        }
    }
    fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }
    fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
    fn as_bool(&self) -> Option<bool> {
        match self {
            GgufValue::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

/// ggml tensor types this importer dequantises, with their ids in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Bf16,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// `(elements per block, bytes per block)`.
    fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
        }
    }
}

/// One tensor's entry in the GGUF header.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    /// llama.cpp's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// ggml dims, fastest-varying first (the reverse of the PyTorch shape).
    pub dims: Vec<u64>,
    /// ggml type id.
    pub type_id: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensor {
    /// The PyTorch shape (`dims` reversed).
    pub fn shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }
}

/// A parsed GGUF header; tensor data is read on demand.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    /// Metadata key/value pairs.
    pub metadata: BTreeMap<String, GgufValue>,
    /// Tensor entries in file order.
    pub tensors: Vec<GgufTensor>,
    data_start: u64,
}

struct Reader<'a> {
    inner: BufReader<File>,
    path: &'a Path,
}

impl Reader<'_> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.inner
            .read_exact(&mut b)
            .map_err(|e| Error::io(self.path, e))?;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > 1 << 30 {
            return Err(Error::format(self.path, format!("string of {len} bytes")));
        }
        let mut b = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut b)
            .map_err(|e| Error::io(self.path, e))?;
        String::from_utf8(b)
            .map_err(|e| Error::format(self.path, format!("invalid utf-8 string: {e}")))
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U64(u8::from_le_bytes(self.bytes()?) as u64),
            1 => GgufValue::I64(i8::from_le_bytes(self.bytes()?) as i64),
            2 => GgufValue::U64(u16::from_le_bytes(self.bytes()?) as u64),
            3 => GgufValue::I64(i16::from_le_bytes(self.bytes()?) as i64),
            4 => GgufValue::U64(self.u32()? as u64),
            5 => GgufValue::I64(i32::from_le_bytes(self.bytes()?) as i64),
            6 => GgufValue::F64(f32::from_le_bytes(self.bytes()?) as f64),
            7 => GgufValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => GgufValue::Str(self.string()?),
            9 if depth < 4 => {
                let item = self.u32()?;
                let len = self.u64()?;
                if len > 1 << 28 {
                    return Err(Error::format(self.path, format!("array of {len} items")));
                }
                let items = (0..len)
                    .map(|_| self.value(item, depth + 1))
                    .collect::<Result<Vec<_>>>()?;
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.bytes()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.bytes()?)),
            other => {
                return Err(Error::format(
                    self.path,
                    format!("unknown metadata value type {other}"),
                ));
            }
        })
    }
}

impl GgufFile {
    /// Parses the header of `path` (GGUF versions 2 and 3).
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let mut r = Reader {
            inner: BufReader::new(file),
            path,
        };
        if &r.bytes::<4>()? != b"GGUF" {
            return Err(Error::format(path, "not a GGUF file (bad magic)"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::format(
                path,
                format!("unsupported GGUF version {version}"),
            ));
        }
        let (n_tensors, n_kv) = (r.u64()?, r.u64()?);
        if n_tensors > 1 << 24 || n_kv > 1 << 24 {
            return Err(Error::format(
                path,
                format!("implausible counts: {n_tensors} tensors, {n_kv} keys"),
            ));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            metadata.insert(key, r.value(ty, 0)?);
        }
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > 4 {
                return Err(Error::format(
                    path,
                    format!("tensor `{name}` has {n_dims} dims"),
                ));
            }
            let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
            let type_id = r.u32()?;
            let offset = r.u64()?;
            tensors.push(GgufTensor {
                name,
                dims,
                type_id,
                offset,
            });
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(GgufValue::as_i64)
            .unwrap_or(32)
            .max(1) as u64;
        let pos = r.inner.stream_position().map_err(|e| Error::io(path, e))?;
        let data_start = pos.div_ceil(alignment) * alignment;
        Ok(GgufFile {
            path: path.to_owned(),
            metadata,
            tensors,
            data_start,
        })
    }

    /// Reads and dequantises one tensor to f32 in its PyTorch shape.
    pub fn tensor(&self, t: &GgufTensor) -> Result<Tensor> {
        let path = &self.path;
        let ty = GgmlType::from_id(t.type_id).ok_or_else(|| {
            Error::format(
                path,
                format!(
                    "tensor `{}` has ggml type {} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)",
                    t.name, t.type_id
                ),
            )
        })?;
        let numel: u64 = t.dims.iter().product();
        let (block, block_bytes) = ty.block();
        if !numel.is_multiple_of(block as u64) {
            return Err(Error::format(
                path,
                format!(
                    "tensor `{}`: {numel} elements are not whole {ty:?} blocks",
                    t.name
                ),
            ));
        }
        let n_bytes = numel / block as u64 * block_bytes as u64;
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        file.seek(SeekFrom::Start(self.data_start + t.offset))
            .map_err(|e| Error::io(path, e))?;
        let mut raw = vec![0u8; n_bytes as usize];
        file.read_exact(&mut raw)
            .map_err(|e| Error::format(path, format!("tensor `{}` is truncated: {e}", t.name)))?;
        let values = dequantize(ty, &raw);
        Ok(Tensor::from_slice(&values).view(t.shape().as_slice()))
    }

    fn get(&self, key: &str) -> Result<&GgufValue> {
        self.metadata
            .get(key)
            .ok_or_else(|| Error::format(&self.path, format!("missing metadata key `{key}`")))
    }

    fn int(&self, key: &str) -> Result<i64> {
        self.get(key)?
            .as_i64()
            .ok_or_else(|| Error::format(&self.path, format!("metadata `{key}` is not an integer")))
    }

    fn float(&self, key: &str) -> Result<f64> {
        self.get(key)?
            .as_f64()
            .ok_or_else(|| Error::format(&self.path, format!("metadata `{key}` is not a number")))
    }

    fn str(&self, key: &str) -> Result<&str> {
        self.get(key)?
            .as_str()
            .ok_or_else(|| Error::format(&self.path, format!("metadata `{key}` is not a string")))
    }

    fn strings(&self, key: &str) -> Result<Vec<&str>> {
        let items = self.get(key)?.as_array();
        items
            .and_then(|a| a.iter().map(GgufValue::as_str).collect::<Option<Vec<_>>>())
            .ok_or_else(|| {
                Error::format(
                    &self.path,
                    format!("metadata `{key}` is not an array of strings"),
                )
            })
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantises whole blocks of `ty` (ggml's reference `dequantize_row_*`).
fn dequantize(ty: GgmlType, raw: &[u8]) -> Vec<f32> {
    let (_, bytes) = ty.block();
    match ty {
        GgmlType::F32 => raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        GgmlType::F16 => raw
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        GgmlType::Bf16 => raw
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => {
            let mut out = Vec::with_capacity(raw.len() / bytes * 32);
            for b in raw.chunks_exact(bytes) {
                let mut y = [0f32; 32];
                match ty {
                    GgmlType::Q8_0 => {
                        let d = f16_at(b, 0);
                        for (j, q) in b[2..34].iter().enumerate() {
                            y[j] = (*q as i8) as f32 * d;
                        }
                    }
                    GgmlType::Q4_0 | GgmlType::Q4_1 => {
                        let d = f16_at(b, 0);
                        let (m, qs, offset) = if ty == GgmlType::Q4_1 {
                            (f16_at(b, 2), &b[4..20], 0.0)
                        } else {
                            (0.0, &b[2..18], 8.0)
                        };
                        for (j, q) in qs.iter().enumerate() {
                            y[j] = ((q & 0x0F) as f32 - offset) * d + m;
                            y[j + 16] = ((q >> 4) as f32 - offset) * d + m;
                        }
                    }
                    GgmlType::Q5_0 | GgmlType::Q5_1 => {
                        let d = f16_at(b, 0);
                        let (m, at, offset) = if ty == GgmlType::Q5_1 {
                            (f16_at(b, 2), 4, 0.0)
                        } else {
                            (0.0, 2, 16.0)
                        };
                        let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                        for (j, q) in b[at + 4..at + 20].iter().enumerate() {
                            let h0 = ((qh >> j) << 4) & 0x10;
                            let h1 = (qh >> (j + 12)) & 0x10;
                            y[j] = (((q & 0x0F) as u32 | h0) as f32 - offset) * d + m;
                            y[j + 16] = (((q >> 4) as u32 | h1) as f32 - offset) * d + m;
                        }
                    }
                    _ => unreachable!("plain types handled above"),
                }
                out.extend_from_slice(&y);
            }
            out
        }
    }
}

/// What [`import`] wrote.
#[derive(Debug, Clone)]
pub struct ImportReport {
    /// The Hugging Face directory written.
    pub out_dir: PathBuf,
    /// `architectures[0]` of the written config.
    pub architecture: String,
    /// Tensors written to model.safetensors.
    pub tensors: usize,
    /// Count of source tensors per ggml type name (e.g. `"Q4_1" -> 210`).
    pub source_types: BTreeMap<String, usize>,
    /// Tokens in the vocabulary.
    pub vocab_size: i64,
    /// Whether the output ties `lm_head` to the embeddings (no `output.weight` in the file).
    pub tie_word_embeddings: bool,
}

/// Maps a llama.cpp tensor name to its Hugging Face name.
fn hf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_owned());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, leaf) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = leaf.rsplit_once('.')?;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Undoes llama.cpp's `permute` of q/k rows (done at conversion for its RoPE layout).
///
/// # Shapes
/// - `w`: `[n_heads * head_dim, in]` (weight) or `[n_heads * head_dim]` (bias)
fn unpermute(w: &Tensor, n_heads: i64) -> Tensor {
    let size = w.size();
    let rows = size[0];
    let rest: Vec<i64> = size[1..].to_vec();
    let mut view = vec![n_heads, rows / n_heads / 2, 2];
    view.extend(&rest);
    // [n_heads, head_dim / 2, 2, ...] -> [n_heads, 2, head_dim / 2, ...]
    w.view(view.as_slice())
        .transpose(1, 2)
        .reshape(size.as_slice())
}

fn shortest_f32(v: f64) -> f64 {
    format!("{}", v as f32).parse().unwrap_or(v)
}

/// Imports `gguf_path` into the Hugging Face directory `out_dir` (created if needed).
pub fn import(gguf_path: impl AsRef<Path>, out_dir: impl AsRef<Path>) -> Result<ImportReport> {
    let (gguf_path, out_dir) = (gguf_path.as_ref(), out_dir.as_ref());
    let g = GgufFile::open(gguf_path)?;
    let arch = g.str("general.architecture")?.to_owned();
    if arch != "llama" {
        return Err(Error::format(
            gguf_path,
            format!("general.architecture is {arch:?}; only \"llama\" is supported"),
        ));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = g.int(&key("embedding_length"))?;
    let n_heads = g.int(&key("attention.head_count"))?;
    let n_kv_heads = g
        .metadata
        .get(&key("attention.head_count_kv"))
        .and_then(GgufValue::as_i64)
        .unwrap_or(n_heads);
    let tokens = g.strings("tokenizer.ggml.tokens")?;
    let vocab = g
        .metadata
        .get(&key("vocab_size"))
        .and_then(GgufValue::as_i64)
        .unwrap_or(tokens.len() as i64);
    let head_dim = g
        .metadata
        .get(&key("rope.dimension_count"))
        .and_then(GgufValue::as_i64)
        .unwrap_or(hidden / n_heads);
    let tie = !g.tensors.iter().any(|t| t.name == "output.weight");
    let token_id = |k: &str| g.metadata.get(k).and_then(GgufValue::as_i64);
    let (bos, eos, pad) = (
        token_id("tokenizer.ggml.bos_token_id"),
        token_id("tokenizer.ggml.eos_token_id"),
        token_id("tokenizer.ggml.padding_token_id"),
    );
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": g.int(&key("feed_forward_length"))?,
        "num_hidden_layers": g.int(&key("block_count"))?,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": shortest_f32(g.float(&key("attention.layer_norm_rms_epsilon"))?),
        "rope_theta": shortest_f32(g.metadata.get(&key("rope.freq_base")).and_then(GgufValue::as_f64).unwrap_or(10000.0)),
        "rope_scaling": null,
        "max_position_embeddings": g.int(&key("context_length"))?,
        "tie_word_embeddings": tie,
        "attention_bias": false,
        "mlp_bias": false,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "use_cache": true,
    });
    // check the config parses as ours before writing anything big
    let cfg: crate::model::Config = serde_json::from_value(config.clone())
        .map_err(|e| Error::format(gguf_path, format!("derived config: {e}")))?;
    cfg.family()?;

    let mut tensors = Vec::new();
    let mut source_types: BTreeMap<String, usize> = BTreeMap::new();
    for t in &g.tensors {
        if t.name == "rope_freqs.weight" {
            continue; // llama.cpp's own RoPE table, recomputed from rope_theta
        }
        let name = hf_name(&t.name).ok_or_else(|| {
            Error::format(
                gguf_path,
                format!("tensor `{}` has no Hugging Face equivalent", t.name),
            )
        })?;
        let ty = GgmlType::from_id(t.type_id)
            .map_or_else(|| format!("type{}", t.type_id), |ty| format!("{ty:?}"));
        *source_types.entry(ty.to_uppercase()).or_default() += 1;
        let mut w = g.tensor(t)?;
        if name.ends_with("q_proj.weight") || name.ends_with("q_proj.bias") {
            w = unpermute(&w, n_heads);
        } else if name.ends_with("k_proj.weight") || name.ends_with("k_proj.bias") {
            w = unpermute(&w, n_kv_heads);
        }
        tensors.push((name, w.to_kind(Kind::Float)));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));

    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    write_json(&out_dir.join("config.json"), &config)?;
    let mut generation = json!({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad});
    generation["transformers_version"] = json!("4.57.6");
    write_json(&out_dir.join("generation_config.json"), &generation)?;
    hf::write_safetensors(&tensors, &out_dir.join(hf::SAFETENSORS))?;
    write_tokenizer(&g, &tokens, out_dir)?;
    // the model must load as ours: every tensor present with the config's shapes
    crate::heads::CausalLm::from_pretrained(out_dir, tch::Device::Cpu, Kind::Float)?;
    Ok(ImportReport {
        out_dir: out_dir.to_owned(),
        architecture: "LlamaForCausalLM".to_owned(),
        tensors: tensors.len(),
        source_types,
        vocab_size: vocab,
        tie_word_embeddings: tie,
    })
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text =
        serde_json::to_string_pretty(value).map_err(|e| Error::format(path, e.to_string()))?;
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

/// Writes tokenizer.json (byte-level BPE) and tokenizer_config.json from the GGUF vocabulary.
fn write_tokenizer(g: &GgufFile, tokens: &[&str], out_dir: &Path) -> Result<()> {
    let path = &g.path;
    let model = g.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(Error::format(
            path,
            format!(
                "tokenizer.ggml.model is {model:?}; only \"gpt2\" (byte-level BPE) is supported"
            ),
        ));
    }
    let pre = g
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(GgufValue::as_str)
        .unwrap_or("default");
    let merges = g.strings("tokenizer.ggml.merges")?;
    let types: Vec<i64> = match g
        .metadata
        .get("tokenizer.ggml.token_type")
        .and_then(GgufValue::as_array)
    {
        Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    // llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    let mut added = Vec::new();
    let mut added_decoder = serde_json::Map::new();
    for (id, (tok, ty)) in tokens.iter().zip(&types).enumerate() {
        if *ty == 3 || *ty == 4 {
            let special = *ty == 3;
            let entry = json!({"id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false, "normalized": !special, "special": special});
            added.push(entry.clone());
            let mut dec = entry;
            dec.as_object_mut().map(|o| o.remove("id"));
            added_decoder.insert(id.to_string(), dec);
        }
    }
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| ((*t).to_owned(), Value::from(i as i64)))
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    // SmolLM's pre-tokenizer splits every digit into its own token before byte-level BPE
    let pre_tokenizer = match pre {
        "smollm" => {
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]})
        }
        "gpt-2" | "default" => byte_level,
        other => {
            return Err(Error::format(
                path,
                format!("tokenizer.ggml.pre {other:?} is not supported (supported: smollm, gpt-2)"),
            ));
        }
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    let tok_path = out_dir.join("tokenizer.json");
    write_json(&tok_path, &tokenizer)?;
    tokenizers::Tokenizer::from_file(&tok_path)
        .map_err(|e| Error::format(&tok_path, format!("written tokenizer does not load: {e}")))?;

    let token = |key: &str| {
        g.metadata
            .get(key)
            .and_then(GgufValue::as_i64)
            .and_then(|id| tokens.get(id as usize))
            .map(|t| Value::from(*t))
            .unwrap_or(Value::Null)
    };
    let chat_template = g
        .metadata
        .get("tokenizer.chat_template")
        .and_then(GgufValue::as_str);
    let add_bos = g
        .metadata
        .get("tokenizer.ggml.add_bos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let max_len = g.int("llama.context_length").unwrap_or(2048);
    let special: Vec<Value> = added
        .iter()
        .filter(|a| a["special"] == json!(true))
        .map(|a| a["content"].clone())
        .collect();
    let config = json!({
        "add_bos_token": add_bos,
        "add_prefix_space": false,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": special,
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": false,
        "model_max_length": max_len,
        "tokenizer_class": "GPT2Tokenizer",
        "vocab_size": tokens.len(),
    });
    write_json(&out_dir.join("tokenizer_config.json"), &config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn q8_0_block_scales_signed_bytes() {
        let mut b = f16b(0.5).to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = dequantize(GgmlType::Q8_0, &b);
        assert_eq!(y.len(), 32);
        assert_eq!(y[0], -8.0);
        assert_eq!(y[31], 7.5);
    }

    #[test]
    fn q4_0_and_q4_1_use_low_nibbles_first() {
        let mut b = f16b(2.0).to_vec();
        b.extend((0..16).map(|j| (j as u8) | (15 - j as u8) << 4));
        let y = dequantize(GgmlType::Q4_0, &b);
        assert_eq!(
            (y[0], y[1], y[16], y[31]),
            (
                (0.0 - 8.0) * 2.0,
                (1.0 - 8.0) * 2.0,
                (15.0 - 8.0) * 2.0,
                (0.0 - 8.0) * 2.0
            )
        );
        let mut b = f16b(0.5).to_vec();
        b.extend(f16b(-1.0));
        b.extend((0..16).map(|j| (j as u8) | (15 - j as u8) << 4));
        let y = dequantize(GgmlType::Q4_1, &b);
        assert_eq!((y[3], y[16]), (3.0 * 0.5 - 1.0, 15.0 * 0.5 - 1.0));
    }

    #[test]
    fn q5_0_takes_the_fifth_bit_from_qh() {
        let mut b = f16b(1.0).to_vec();
        b.extend(0x0001_0001u32.to_le_bytes()); // bit 0 -> y[0], bit 16 -> y[16]
        b.extend([0u8; 16]);
        let y = dequantize(GgmlType::Q5_0, &b);
        assert_eq!((y[0], y[1], y[16], y[20]), (0.0, -16.0, 0.0, -16.0));
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let (n_heads, head_dim, inp) = (3i64, 4i64, 2i64);
        let w = Tensor::arange(n_heads * head_dim * inp, (Kind::Float, tch::Device::Cpu))
            .view([n_heads * head_dim, inp]);
        // llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)
        let permuted = w
            .view([n_heads, 2, head_dim / 2, inp])
            .transpose(1, 2)
            .reshape([n_heads * head_dim, inp]);
        assert!(unpermute(&permuted, n_heads).equal(&w));
    }

    #[test]
    fn names_map_to_hugging_face() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").unwrap(),
            "model.layers.12.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").unwrap(),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            hf_name("token_embd.weight").unwrap(),
            "model.embed_tokens.weight"
        );
        assert!(hf_name("blk.0.mystery.weight").is_none());
    }

    #[test]
    fn non_gguf_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.gguf");
        std::fs::write(&p, b"NOPE....").unwrap();
        let err = GgufFile::open(&p).unwrap_err().to_string();
        assert!(err.contains("bad magic") && err.contains("x.gguf"), "{err}");
    }
}
