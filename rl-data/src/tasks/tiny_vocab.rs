//! A character-level Hugging Face tokenizer (every printable ASCII character, newline and
//! ChatML specials) written as real `tokenizer.json` + `tokenizer_config.json` files, for tiny
//! models that train in seconds; and a short-prompt addition task for them.

use std::path::Path;

use serde_json::{Map, Value, json};

use super::{GeneratedFiles, SplitSizes, TaskRng, generate_splits};
use crate::error::{Error, Result};
use crate::parquet_io::RlRecord;
use crate::tokenizer::Message;

/// The special tokens, in id order from 0: pad, unk, `<|im_start|>`, `<|im_end|>` (the eos).
pub const TINY_SPECIALS: [&str; 4] = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"];

/// The ChatML template of the tiny tokenizer.
pub const TINY_CHAT_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The vocabulary: the specials, then `\n` and the printable ASCII characters.
pub fn tiny_vocab() -> Vec<String> {
    let mut v: Vec<String> = TINY_SPECIALS.iter().map(|s| s.to_string()).collect();
    v.push("\n".into());
    v.extend((0x20u8..0x7f).map(|c| (c as char).to_string()));
    v
}

/// Writes `tokenizer.json` (WordLevel over single characters, a per-character split and a
/// `Fuse` decoder) and `tokenizer_config.json` (ChatML template, eos `<|im_end|>`, pad `<pad>`)
/// into `dir`; returns the vocabulary size (100).
pub fn write_tiny_tokenizer(dir: &Path) -> Result<usize> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let vocab = tiny_vocab();
    let map: Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), Value::from(i)))
        .collect();
    let added: Vec<Value> = TINY_SPECIALS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": map, "unk_token": "<unk>"}
    });
    let config = json!({
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": TINY_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast"
    });
    for (name, value) in [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", config),
    ] {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(&value).map_err(|e| Error::Config {
            key: name.into(),
            message: e.to_string(),
        })?;
        std::fs::write(&path, text).map_err(|source| Error::Io { path, source })?;
    }
    Ok(vocab.len())
}

/// Options of [`generate_tiny_addition`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TinyAddition {
    /// Operands are drawn from `0..=max_operand`; at least 1.
    pub max_operand: i64,
    /// Draw only pairs whose digit-wise sums stay below 10, so each answer digit depends on one
    /// digit pair.
    pub no_carry: bool,
    /// Write operands and answers zero-padded to the width of `max_operand` (`03+45=48`), so
    /// the digits to add sit at fixed distances from the answer (a tiny model learns and
    /// generalises that quickly). The ground truth stays the plain integer.
    pub zero_pad: bool,
}

/// Writes `dir/{train,test}.parquet` of `a+b=` prompts (`data_source = "arithmetic"`, ground
/// truth the sum as a string, `extra_info.answer` the SFT target as written, `extra_info.question`
/// the prompt's text, as verl's GSM8K preprocessing keeps them). Test prompts never
/// repeat a train prompt.
pub fn generate_tiny_addition(
    dir: &Path,
    task: TinyAddition,
    sizes: SplitSizes,
    seed: u64,
) -> Result<GeneratedFiles> {
    let max_operand = task.max_operand;
    if max_operand < 1 {
        return Err(Error::Config {
            key: "tiny_addition.max_operand".into(),
            message: "must be at least 1".into(),
        });
    }
    let width = if task.zero_pad {
        max_operand.to_string().len()
    } else {
        0
    };
    let answer_width = if task.zero_pad {
        (if task.no_carry {
            max_operand
        } else {
            2 * max_operand
        })
        .to_string()
        .len()
    } else {
        0
    };
    let no_carry = task.no_carry;
    generate_splits(
        dir,
        sizes,
        seed,
        "tiny_addition",
        |rng: &mut TaskRng, split, index| {
            let a = rng.range(0, max_operand);
            let b = rng.range(0, max_operand);
            if no_carry && carries(a, b) {
                return None;
            }
            let answer = format!("{:0answer_width$}", a + b);
            let question = format!("{a:0width$}+{b:0width$}=");
            let mut extra = Map::new();
            extra.insert("split".into(), split.into());
            extra.insert("index".into(), index.into());
            extra.insert("answer".into(), answer.clone().into());
            extra.insert("question".into(), question.clone().into());
            Some(RlRecord {
                data_source: "arithmetic".into(),
                prompt: vec![Message::user(question)],
                ability: "math".into(),
                style: "rule".into(),
                ground_truth: Value::String((a + b).to_string()),
                extra_info: extra,
            })
        },
    )
}

/// [`generate_tiny_addition`], plus `train_pairs.parquet` and `test_pairs.parquet`: each row's
/// prompt with the right sum as `chosen` and a wrong one (fixed per row) as `rejected`, in
/// TRL's preference schema, for offline DPO. Returns the pair files.
pub fn generate_tiny_preferences(
    dir: &Path,
    task: TinyAddition,
    sizes: SplitSizes,
    seed: u64,
) -> Result<GeneratedFiles> {
    let rl = generate_tiny_addition(dir, task, sizes, seed)?;
    let opts = crate::dataset::ReadOptions {
        prompt_key: "prompt".into(),
        reward_fn_key: "data_source".into(),
        max_samples: None,
    };
    let span = if task.no_carry {
        task.max_operand
    } else {
        2 * task.max_operand
    };
    let mut out = Vec::new();
    for (split, file) in [("train", &rl.train), ("test", &rl.test)] {
        let ds = crate::RlDataset::open(std::slice::from_ref(file), &opts)?;
        let mut pairs = Vec::with_capacity(ds.len());
        for i in 0..ds.len() {
            let row = ds.row(i)?;
            let chosen = row
                .extra_info
                .get("answer")
                .and_then(Value::as_str)
                .ok_or_else(|| Error::Config {
                    key: "extra_info.answer".into(),
                    message: format!("row {i} of {} has none", file.display()),
                })?
                .to_string();
            let answer: i64 = chosen.parse().map_err(|_| Error::Config {
                key: "extra_info.answer".into(),
                message: format!("{chosen:?} is not a number"),
            })?;
            // a wrong sum in 0..=span, fixed by the row's index
            let h = ((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) as i64;
            let mut wrong = h % span.max(1);
            if wrong >= answer {
                wrong += 1;
            }
            let rejected = format!("{wrong:0width$}", width = chosen.len());
            pairs.push(crate::PreferenceRecord {
                prompt: row.prompt.clone(),
                chosen,
                rejected,
            });
        }
        let path = dir.join(format!("{split}_pairs.parquet"));
        crate::write_preference_parquet(&path, &pairs)?;
        out.push(path);
    }
    let test = out.pop().unwrap_or_default();
    let train = out.pop().unwrap_or_default();
    Ok(GeneratedFiles { train, test })
}

/// Whether adding `a` and `b` (non-negative) carries at any digit.
fn carries(mut a: i64, mut b: i64) -> bool {
    while a > 0 || b > 0 {
        if a % 10 + b % 10 >= 10 {
            return true;
        }
        a /= 10;
        b /= 10;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tokenizer;

    #[test]
    fn tiny_tokenizer_round_trips_through_from_dir() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(write_tiny_tokenizer(dir.path()).unwrap(), 100);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let text = tok
            .apply_chat_template(&[Message::user("12+3=")], true)
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>user\n12+3=<|im_end|>\n<|im_start|>assistant\n"
        );
        let ids = tok.encode(&text, false).unwrap();
        assert_eq!(ids.len(), 1 + 4 + 1 + 5 + 1 + 1 + 1 + 9 + 1);
        assert_eq!(ids[0], 2);
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\n12+3=\nassistant\n");
        assert_eq!(tok.eos_token_id(), Some(3));
        assert_eq!(tok.pad_token_id(), Some(0));
        assert!(carries(15, 5) && carries(50, 60) && !carries(23, 45) && !carries(0, 0));
    }
}
