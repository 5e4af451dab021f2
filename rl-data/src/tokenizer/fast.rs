//! An exact shortcut for byte-level BPE tokenizers on ASCII text: the same splits and the same
//! BPE model as the `tokenizers` crate, without its offset bookkeeping, with the pre-tokenizer
//! regex run by the `regex` crate instead of oniguruma, and with each distinct word looked up
//! once per batch.
//!
//! It is built only for the pre-tokenizers whose behaviour on ASCII it reproduces exactly:
//! GPT-2's `ByteLevel` regex (optionally after `Digits`, as SmolLM2), and a `Split` with the
//! Llama-3 or Qwen2 regex followed by a regex-less `ByteLevel`. Anything else, and any text with
//! a non-ASCII byte, goes through the `tokenizers` crate. ASCII keeps the Unicode classes of the
//! regexes (`\p{L}`, `\p{N}`, `\s`) unambiguous: oniguruma and `regex` agree on them there,
//! whatever Unicode version either was built with, and every Unicode normal form is the
//! identity on ASCII.
//!
//! The one construct `regex` lacks is the look-ahead in `\s+(?!\S)|\s+`, the tail all three
//! regexes share. It is emulated: the regex runs as `HEAD|\s+`, and when `\s+` wins with a run
//! of two or more whitespace characters followed by a non-space, the match gives back its last
//! character, as the backtracking `\s+(?!\S)` does.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use tokenizers::Model as _;
use tokenizers::models::ModelWrapper;

/// GPT-2's pattern, which `ByteLevel { use_regex: true }` applies.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama-3's `Split` pattern (tiktoken's cl100k style, numbers in groups of up to three).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's `Split` pattern (Llama-3's with single digits).
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The tail every supported pattern ends with; its look-ahead is emulated.
const TAIL: &str = r"|\s+(?!\S)|\s+";

/// The pre-tokenizer regex without its look-ahead.
#[derive(Clone, Debug)]
struct SplitRegex {
    /// `HEAD|\s+`, to find the next match anywhere.
    any: regex::Regex,
    /// `^(?:HEAD|\s+)`: the match starting right here (one forward scan, where `any` also
    /// scans back for the start); every supported pattern matches at every position.
    here: regex::Regex,
    /// `^(?:HEAD)`: whether a whitespace-only match came from HEAD rather than from `\s+`.
    head: regex::Regex,
}

impl SplitRegex {
    fn new(pattern: &str) -> Option<Self> {
        let head = pattern.strip_suffix(TAIL)?;
        Some(Self {
            any: regex::Regex::new(&format!(r"{head}|\s+")).ok()?,
            here: regex::Regex::new(&format!(r"^(?:{head}|\s+)")).ok()?,
            head: regex::Regex::new(&format!("^(?:{head})")).ok()?,
        })
    }

    /// Calls `f` with each piece of `text` (ASCII) as oniguruma's `find_iter` with
    /// `SplitDelimiterBehavior::Isolated` cuts it: the matches and the gaps between them.
    fn split<'a>(&self, text: &'a str, f: &mut impl FnMut(&'a str)) {
        let mut pos = 0;
        while pos < text.len() {
            // The regexes have no look-around, so matching on the rest of the text is matching
            // in context.
            let (start, len) = match self.here.find(&text[pos..]) {
                Some(m) => (pos, m.len()),
                None => match self.any.find_at(text, pos) {
                    Some(m) => {
                        f(&text[pos..m.start()]);
                        (m.start(), m.len())
                    }
                    None => {
                        f(&text[pos..]);
                        return;
                    }
                },
            };
            let mut end = start + len;
            if len >= 2
                && end < text.len()
                && text.as_bytes()[start..end].iter().all(|&b| is_space(b))
                && !self.head.is_match(&text[start..])
            {
                // `\s+(?!\S)` would have matched: it leaves the last whitespace byte (ASCII)
                // to the next match.
                end -= 1;
            }
            f(&text[start..end]);
            pos = end;
        }
    }
}

/// `\s` on ASCII: tab, line feed, vertical tab, form feed, carriage return, space.
fn is_space(b: u8) -> bool {
    matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ')
}

/// The `Digits` pre-tokenizer in front of the regex (SmolLM2's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Digits {
    /// Every digit on its own.
    Individual,
    /// Runs of digits together.
    Contiguous,
}

/// Byte-level BPE without the `tokenizers` crate's pipeline, exact on ASCII text.
#[derive(Clone, Debug)]
pub(super) struct AsciiByteLevel {
    digits: Option<Digits>,
    split: SplitRegex,
    /// `ByteLevel`'s byte-to-character map for the 128 ASCII bytes.
    chars: [char; 128],
}

/// Words already encoded in this batch: the word (a slice of the input) to a range of `ids`.
#[derive(Debug, Default)]
pub(super) struct WordCache<'a> {
    words: HashMap<&'a str, (u32, u32), BuildHasherDefault<FxHasher>>,
    ids: Vec<u32>,
}

/// rustc's Fx hash: a multiply-rotate per 8 bytes, several times cheaper than the default
/// SipHash on words of a few bytes. (The cache lives for one batch, keyed by that batch's text.)
#[derive(Debug, Default, Clone, Copy)]
struct FxHasher(u64);

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl AsciiByteLevel {
    /// The shortcut for `inner`, when its normalizer, pre-tokenizer and model are ones it
    /// reproduces exactly on ASCII; `None` otherwise.
    pub(super) fn new(inner: &tokenizers::Tokenizer) -> Option<Self> {
        match inner.get_model() {
            ModelWrapper::BPE(bpe) if bpe.dropout.is_none_or(|p| p == 0.0) => {}
            _ => return None,
        }
        if let Some(n) = inner.get_normalizer()
            && !identity_on_ascii(&serde_json::to_value(n).ok()?)
        {
            return None;
        }
        let pre = serde_json::to_value(inner.get_pre_tokenizer()?).ok()?;
        let (digits, pattern) = recognise(&pre)?;
        Some(Self {
            digits,
            split: SplitRegex::new(pattern)?,
            chars: ascii_byte_chars(),
        })
    }

    /// Appends the ids of `text` (ASCII, no added tokens in it) to `out`.
    pub(super) fn encode_into<'a>(
        &self,
        model: &ModelWrapper,
        text: &'a str,
        cache: &mut WordCache<'a>,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        debug_assert!(text.is_ascii());
        let mut err = None;
        let mut word = |w: &'a str| {
            if err.is_some() {
                return;
            }
            if let Some(&(lo, hi)) = cache.words.get(w) {
                out.extend_from_slice(&cache.ids[lo as usize..hi as usize]);
                return;
            }
            let mapped: String = w.bytes().map(|b| self.chars[usize::from(b)]).collect();
            match model.tokenize(&mapped) {
                Ok(tokens) => {
                    let lo = cache.ids.len() as u32;
                    cache.ids.extend(tokens.iter().map(|t| t.id));
                    out.extend(tokens.iter().map(|t| t.id));
                    cache.words.insert(w, (lo, cache.ids.len() as u32));
                }
                Err(e) => err = Some(e),
            }
        };
        match self.digits {
            None => self.split.split(text, &mut word),
            Some(mode) => {
                for piece in digit_pieces(text, mode) {
                    self.split.split(piece, &mut word);
                }
            }
        }
        err.map_or(Ok(()), Err)
    }
}

/// `Digits` with `SplitDelimiterBehavior::Isolated` (each digit alone) or `Contiguous` (runs of
/// digits), on ASCII, where `char::is_numeric` is `0-9`.
fn digit_pieces(text: &str, mode: Digits) -> impl Iterator<Item = &str> {
    let b = text.as_bytes();
    let mut pos = 0;
    std::iter::from_fn(move || {
        if pos >= b.len() {
            return None;
        }
        let start = pos;
        if b[pos].is_ascii_digit() {
            pos += 1;
            if mode == Digits::Contiguous {
                while pos < b.len() && b[pos].is_ascii_digit() {
                    pos += 1;
                }
            }
        } else {
            while pos < b.len() && !b[pos].is_ascii_digit() {
                pos += 1;
            }
        }
        Some(&text[start..pos])
    })
}

/// Normalizers that leave ASCII text as it is: the Unicode normal forms, or a sequence of them.
fn identity_on_ascii(n: &serde_json::Value) -> bool {
    match n.get("type").and_then(serde_json::Value::as_str) {
        Some("NFC" | "NFD" | "NFKC" | "NFKD") => true,
        Some("Sequence") => n
            .get("normalizers")
            .and_then(serde_json::Value::as_array)
            .is_some_and(|list| list.iter().all(identity_on_ascii)),
        _ => false,
    }
}

/// The supported pre-tokenizers: `(Digits in front, regex)`.
fn recognise(pre: &serde_json::Value) -> Option<(Option<Digits>, &'static str)> {
    fn ty(v: &serde_json::Value) -> Option<&str> {
        v.get("type").and_then(serde_json::Value::as_str)
    }
    let flag = |v: &serde_json::Value, k: &str| v.get(k).and_then(serde_json::Value::as_bool);
    // ByteLevel with no prefix space; `use_regex` as asked.
    let byte_level = |v: &serde_json::Value, use_regex: bool| {
        ty(v) == Some("ByteLevel")
            && flag(v, "add_prefix_space") == Some(false)
            && flag(v, "use_regex") == Some(use_regex)
    };
    if byte_level(pre, true) {
        return Some((None, GPT2));
    }
    if ty(pre) != Some("Sequence") {
        return None;
    }
    let steps = pre.get("pretokenizers")?.as_array()?;
    let [first, second] = steps.as_slice() else {
        return None;
    };
    match ty(first)? {
        "Digits" if byte_level(second, true) => {
            let mode = if flag(first, "individual_digits")? {
                Digits::Individual
            } else {
                Digits::Contiguous
            };
            Some((Some(mode), GPT2))
        }
        "Split"
            if byte_level(second, false)
                && first.get("behavior")?.as_str()? == "Isolated"
                && !flag(first, "invert")? =>
        {
            let pattern = first.get("pattern")?.get("Regex")?.as_str()?;
            [LLAMA3, QWEN2]
                .into_iter()
                .find(|p| *p == pattern)
                .map(|p| (None, p))
        }
        _ => None,
    }
}

/// GPT-2's `bytes_to_unicode` for the ASCII bytes: printable ones map to themselves, the rest
/// (controls, space, DEL) to `U+0100 + n` in byte order.
fn ascii_byte_chars() -> [char; 128] {
    let mut out = ['\0'; 128];
    let mut n = 0u32;
    for b in 0u8..=255 {
        let printable = matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
        let c = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
            c
        };
        if b < 128 {
            out[usize::from(b)] = c;
        }
    }
    out
}
