//! [`Batch`]: named tensors sharing a leading batch dimension, per-row non-tensor columns and a
//! `meta_info` map, with the operations of verl's `DataProto`.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

use serde_json::{Map, Value};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// Named tensors that share a leading batch dimension, per-row non-tensor columns (strings and
/// JSON values such as `data_source`, `ground_truth`, `uid`), and a `meta_info` map.
///
/// Invariants, checked on every insertion:
/// - every tensor has at least one dimension and `size(0) == len()`;
/// - every column has `len()` values;
/// - a key names a tensor or a column, never both.
///
/// Views: [`select`](Batch::select), [`slice`](Batch::slice), [`split`](Batch::split) and
/// [`chunk`](Batch::chunk) share tensor storage with `self` (no tensor data is copied);
/// [`repeat`](Batch::repeat), [`reorder`](Batch::reorder) and [`concat`](Batch::concat) copy.
/// `Batch` is deliberately not `Clone`: [`shallow_clone`](Batch::shallow_clone) says what it does.
#[doc(alias = "DataProto")]
#[derive(Default)]
pub struct Batch {
    tensors: BTreeMap<String, Tensor>,
    columns: BTreeMap<String, Vec<Value>>,
    meta_info: Map<String, Value>,
}

impl Batch {
    /// An empty batch: no keys, zero rows.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of rows (0 for a batch without keys).
    pub fn len(&self) -> usize {
        self.len_excluding("").unwrap_or(0)
    }

    /// Whether the batch has zero rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The row count implied by every key except `skip`, or `None` when there is no other key.
    fn len_excluding(&self, skip: &str) -> Option<usize> {
        let from_tensor = self
            .tensors
            .iter()
            .find(|(k, _)| k.as_str() != skip)
            .map(|(_, t)| t.size()[0] as usize);
        from_tensor.or_else(|| {
            self.columns
                .iter()
                .find(|(k, _)| k.as_str() != skip)
                .map(|(_, c)| c.len())
        })
    }

    fn all_keys(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys().chain(self.columns.keys())
    }

    fn missing(&self, key: &str) -> Error {
        Error::missing(key, self.all_keys())
    }

    /// Inserts (or replaces) a tensor.
    ///
    /// # Shapes
    /// - `t`: `[batch, ...]` with `batch == self.len()` unless the batch holds no other key
    pub fn insert(&mut self, key: impl Into<String>, t: Tensor) -> Result<()> {
        let key = key.into();
        if t.dim() == 0 {
            return Err(Error::Shape {
                key,
                expected: "[batch, ...]".into(),
                got: vec![],
            });
        }
        if self.columns.contains_key(&key) {
            return Err(Error::DuplicateKey {
                key,
                existing: "column",
            });
        }
        let rows = t.size()[0] as usize;
        if let Some(expected) = self.len_excluding(&key)
            && rows != expected
        {
            return Err(Error::BatchSize {
                key,
                expected,
                got: rows,
            });
        }
        self.tensors.insert(key, t);
        Ok(())
    }

    /// Inserts (or replaces) a non-tensor column with one value per row.
    pub fn insert_column(&mut self, key: impl Into<String>, values: Vec<Value>) -> Result<()> {
        let key = key.into();
        if self.tensors.contains_key(&key) {
            return Err(Error::DuplicateKey {
                key,
                existing: "tensor",
            });
        }
        if let Some(expected) = self.len_excluding(&key)
            && values.len() != expected
        {
            return Err(Error::BatchSize {
                key,
                expected,
                got: values.len(),
            });
        }
        self.columns.insert(key, values);
        Ok(())
    }

    /// The tensor under `key`.
    pub fn get(&self, key: &str) -> Result<&Tensor> {
        self.tensors.get(key).ok_or_else(|| self.missing(key))
    }

    /// The non-tensor column under `key`.
    pub fn column(&self, key: &str) -> Result<&[Value]> {
        self.columns
            .get(key)
            .map(Vec::as_slice)
            .ok_or_else(|| self.missing(key))
    }

    /// Whether `key` names a tensor or a column.
    pub fn contains(&self, key: &str) -> bool {
        self.tensors.contains_key(key) || self.columns.contains_key(key)
    }

    /// Tensor keys, sorted.
    pub fn tensor_keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Column keys, sorted.
    pub fn column_keys(&self) -> impl Iterator<Item = &str> {
        self.columns.keys().map(String::as_str)
    }

    /// The `meta_info` map (batch-level values such as `temperature` or `global_token_num`).
    pub fn meta_info(&self) -> &Map<String, Value> {
        &self.meta_info
    }

    /// Mutable access to `meta_info`.
    pub fn meta_info_mut(&mut self) -> &mut Map<String, Value> {
        &mut self.meta_info
    }

    /// Removes and returns the tensor under `key`.
    pub fn pop(&mut self, key: &str) -> Result<Tensor> {
        match self.tensors.remove(key) {
            Some(t) => Ok(t),
            None => Err(self.missing(key)),
        }
    }

    /// Removes and returns the column under `key`.
    pub fn pop_column(&mut self, key: &str) -> Result<Vec<Value>> {
        match self.columns.remove(key) {
            Some(c) => Ok(c),
            None => Err(self.missing(key)),
        }
    }

    /// Renames a tensor or column; `to` must not exist yet.
    pub fn rename(&mut self, from: &str, to: impl Into<String>) -> Result<()> {
        let to = to.into();
        if let Some(existing) = self.kind_of(&to) {
            return Err(Error::DuplicateKey { key: to, existing });
        }
        if let Some(t) = self.tensors.remove(from) {
            self.tensors.insert(to, t);
        } else if let Some(c) = self.columns.remove(from) {
            self.columns.insert(to, c);
        } else {
            return Err(self.missing(from));
        }
        Ok(())
    }

    fn kind_of(&self, key: &str) -> Option<&'static str> {
        if self.tensors.contains_key(key) {
            Some("tensor")
        } else if self.columns.contains_key(key) {
            Some("column")
        } else {
            None
        }
    }

    /// A batch sharing storage with this one (tensors are shallow clones, columns are copied).
    pub fn shallow_clone(&self) -> Batch {
        Batch {
            tensors: self
                .tensors
                .iter()
                .map(|(k, t)| (k.clone(), t.shallow_clone()))
                .collect(),
            columns: self.columns.clone(),
            meta_info: self.meta_info.clone(),
        }
    }

    /// A batch with only `keys` (tensors or columns), sharing tensor storage; `meta_info` is kept.
    pub fn select(&self, keys: &[&str]) -> Result<Batch> {
        let mut out = Batch {
            meta_info: self.meta_info.clone(),
            ..Batch::default()
        };
        for &key in keys {
            if let Some(t) = self.tensors.get(key) {
                out.tensors.insert(key.to_owned(), t.shallow_clone());
            } else if let Some(c) = self.columns.get(key) {
                out.columns.insert(key.to_owned(), c.clone());
            } else {
                return Err(self.missing(key));
            }
        }
        Ok(out)
    }

    /// Merges `other` into `self` (verl's `union`). A key on both sides must hold equal values
    /// (same shape, dtype and elements, or equal JSON), else [`Error::Conflict`] names it; nothing
    /// is modified when an error is returned.
    pub fn union(&mut self, other: Batch) -> Result<()> {
        if let (Some(mine), Some(theirs)) = (self.len_excluding(""), other.len_excluding(""))
            && mine != theirs
        {
            let key = other.all_keys().next().cloned().unwrap_or_default();
            return Err(Error::BatchSize {
                key,
                expected: mine,
                got: theirs,
            });
        }
        for (key, t) in &other.tensors {
            if self.columns.contains_key(key) {
                return Err(Error::DuplicateKey {
                    key: key.clone(),
                    existing: "column",
                });
            }
            if let Some(mine) = self.tensors.get(key)
                && !same_tensor(mine, t)?
            {
                return Err(Error::Conflict { key: key.clone() });
            }
        }
        for (key, c) in &other.columns {
            if self.tensors.contains_key(key) {
                return Err(Error::DuplicateKey {
                    key: key.clone(),
                    existing: "tensor",
                });
            }
            if self.columns.get(key).is_some_and(|mine| mine != c) {
                return Err(Error::Conflict { key: key.clone() });
            }
        }
        for (key, v) in &other.meta_info {
            if self.meta_info.get(key).is_some_and(|mine| mine != v) {
                return Err(Error::Conflict { key: key.clone() });
            }
        }
        for (key, t) in other.tensors {
            self.tensors.entry(key).or_insert(t);
        }
        for (key, c) in other.columns {
            self.columns.entry(key).or_insert(c);
        }
        for (key, v) in other.meta_info {
            self.meta_info.entry(key).or_insert(v);
        }
        Ok(())
    }

    /// Concatenates batches along rows. Every part must hold the same keys with the same dtypes
    /// and trailing dimensions; `meta_info` maps are merged and must agree where keys overlap.
    pub fn concat(parts: &[Batch]) -> Result<Batch> {
        let Some(first) = parts.first() else {
            return Err(Error::InvalidArgument {
                name: "parts",
                reason: "no batch to concat".into(),
            });
        };
        for (i, part) in parts.iter().enumerate().skip(1) {
            check_same_keys(i, first.all_keys(), part)?;
            check_same_keys_rev(i, first, part.all_keys())?;
        }
        let mut out = Batch::default();
        for (key, t0) in &first.tensors {
            let pieces: Vec<&Tensor> = parts.iter().map(|p| &p.tensors[key]).collect();
            for piece in &pieces[1..] {
                if piece.kind() != t0.kind() {
                    return Err(Error::Dtype {
                        key: key.clone(),
                        expected: format!("{:?} (as in part 0)", t0.kind()),
                        got: piece.kind(),
                    });
                }
                if piece.size()[1..] != t0.size()[1..] {
                    let mut want = vec!["rows".to_owned()];
                    want.extend(t0.size()[1..].iter().map(i64::to_string));
                    return Err(Error::Shape {
                        key: key.clone(),
                        expected: format!("[{}] (as in part 0)", want.join(", ")),
                        got: piece.size(),
                    });
                }
            }
            out.tensors.insert(key.clone(), Tensor::f_cat(&pieces, 0)?);
        }
        for key in first.columns.keys() {
            let joined: Vec<Value> = parts
                .iter()
                .flat_map(|p| p.columns[key].iter().cloned())
                .collect();
            out.columns.insert(key.clone(), joined);
        }
        for part in parts {
            for (key, v) in &part.meta_info {
                match out.meta_info.get(key) {
                    Some(mine) if mine != v => return Err(Error::Conflict { key: key.clone() }),
                    Some(_) => {}
                    None => {
                        out.meta_info.insert(key.clone(), v.clone());
                    }
                }
            }
        }
        Ok(out)
    }

    /// Rows `range` as a batch sharing tensor storage with `self`.
    pub fn slice(&self, range: Range<usize>) -> Result<Batch> {
        let len = self.len();
        if range.start > range.end || range.end > len {
            return Err(Error::InvalidArgument {
                name: "range",
                reason: format!("{}..{} is not within 0..{len}", range.start, range.end),
            });
        }
        let (start, n) = (range.start as i64, (range.end - range.start) as i64);
        let mut out = Batch {
            meta_info: self.meta_info.clone(),
            ..Batch::default()
        };
        for (key, t) in &self.tensors {
            out.tensors.insert(key.clone(), t.f_narrow(0, start, n)?);
        }
        for (key, c) in &self.columns {
            out.columns.insert(key.clone(), c[range.clone()].to_vec());
        }
        Ok(out)
    }

    /// Consecutive pieces of `size` rows (the last may be shorter), as views (verl's `split`).
    /// A batch of zero rows gives one empty piece.
    pub fn split(&self, size: usize) -> Result<Vec<Batch>> {
        if size == 0 {
            return Err(Error::InvalidArgument {
                name: "size",
                reason: "must be at least 1".into(),
            });
        }
        let len = self.len();
        if len == 0 {
            return Ok(vec![self.shallow_clone()]);
        }
        (0..len)
            .step_by(size)
            .map(|start| self.slice(start..(start + size).min(len)))
            .collect()
    }

    /// `n` equal pieces, as views (verl's `chunk`); `len()` must be divisible by `n`.
    pub fn chunk(&self, n: usize) -> Result<Vec<Batch>> {
        let len = self.len();
        if n == 0 || !len.is_multiple_of(n) {
            return Err(Error::UnevenChunk { len, chunks: n });
        }
        let size = len / n;
        (0..n)
            .map(|i| self.slice(i * size..(i + 1) * size))
            .collect()
    }

    /// Each row repeated `n` times: `[a, a, b, b]` when `interleave`, else `[a, b, a, b]`.
    pub fn repeat(&self, n: usize, interleave: bool) -> Result<Batch> {
        if n == 0 {
            return Err(Error::InvalidArgument {
                name: "n",
                reason: "must be at least 1".into(),
            });
        }
        let mut out = Batch {
            meta_info: self.meta_info.clone(),
            ..Batch::default()
        };
        for (key, t) in &self.tensors {
            let repeated = if interleave {
                t.f_repeat_interleave_self_int(n as i64, 0, None::<i64>)?
            } else {
                let mut reps = vec![1i64; t.dim()];
                reps[0] = n as i64;
                t.f_repeat(reps.as_slice())?
            };
            out.tensors.insert(key.clone(), repeated);
        }
        for (key, c) in &self.columns {
            let repeated: Vec<Value> = if interleave {
                c.iter()
                    .flat_map(|v| std::iter::repeat_n(v, n))
                    .cloned()
                    .collect()
            } else {
                (0..n).flat_map(|_| c.iter()).cloned().collect()
            };
            out.columns.insert(key.clone(), repeated);
        }
        Ok(out)
    }

    /// Rows gathered in the order of `indices` (repeats allowed), as a new batch.
    pub fn reorder(&self, indices: &[i64]) -> Result<Batch> {
        let len = self.len();
        if let Some(&bad) = indices.iter().find(|&&i| i < 0 || i as usize >= len) {
            return Err(Error::IndexOutOfRange { index: bad, len });
        }
        let index = Tensor::from_slice(indices);
        let mut out = Batch {
            meta_info: self.meta_info.clone(),
            ..Batch::default()
        };
        let mut on_device: Vec<(Device, Tensor)> = Vec::new();
        for (key, t) in &self.tensors {
            let device = t.device();
            let idx = match on_device.iter().find(|(d, _)| *d == device) {
                Some((_, idx)) => idx.shallow_clone(),
                None => {
                    let idx = index.f_to_device(device)?;
                    on_device.push((device, idx.shallow_clone()));
                    idx
                }
            };
            out.tensors.insert(key.clone(), t.f_index_select(0, &idx)?);
        }
        for (key, c) in &self.columns {
            out.columns.insert(
                key.clone(),
                indices.iter().map(|&i| c[i as usize].clone()).collect(),
            );
        }
        Ok(out)
    }

    /// Pads the batch with copies of its first rows so that `divisor` divides its length
    /// (verl's `pad_dataproto_to_divisor`); returns the padded batch and the number of rows added.
    pub fn pad_to_divisor(&self, divisor: usize) -> Result<(Batch, usize)> {
        if divisor == 0 {
            return Err(Error::InvalidArgument {
                name: "divisor",
                reason: "must be at least 1".into(),
            });
        }
        let len = self.len();
        let pad = (divisor - len % divisor) % divisor;
        if pad == 0 {
            return Ok((self.shallow_clone(), 0));
        }
        // pad > 0 implies len > 0, so the loop below terminates.
        let mut parts = vec![self.shallow_clone()];
        let mut remaining = pad;
        while remaining > 0 {
            let take = remaining.min(len);
            parts.push(self.slice(0..take)?);
            remaining -= take;
        }
        Ok((Batch::concat(&parts)?, pad))
    }

    /// Drops the last `pad` rows added by [`pad_to_divisor`](Batch::pad_to_divisor), as a view.
    pub fn unpad(&self, pad: usize) -> Result<Batch> {
        let len = self.len();
        if pad > len {
            return Err(Error::InvalidArgument {
                name: "pad",
                reason: format!("{pad} exceeds the batch's {len} rows"),
            });
        }
        self.slice(0..len - pad)
    }

    /// The batch with every tensor on `device`.
    pub fn to(&self, device: Device) -> Result<Batch> {
        let mut out = Batch {
            columns: self.columns.clone(),
            meta_info: self.meta_info.clone(),
            ..Batch::default()
        };
        for (key, t) in &self.tensors {
            out.tensors.insert(key.clone(), t.f_to_device(device)?);
        }
        Ok(out)
    }

    /// Mini-batches of `size` rows over `epochs` passes (verl's `make_iterator`), for PPO epochs.
    ///
    /// Without `shuffle` the mini-batches are consecutive views. With `shuffle` each epoch draws
    /// a fresh permutation from one ChaCha stream seeded by `seed`, so the sequence of mini-batches
    /// depends only on `(len, size, seed, epochs)`. `size` must divide `len()`.
    pub fn iter_minibatches(
        &self,
        size: usize,
        shuffle: bool,
        seed: u64,
        epochs: usize,
    ) -> Result<MiniBatches<'_>> {
        let len = self.len();
        if size == 0 || !len.is_multiple_of(size) {
            return Err(Error::UnevenMiniBatch { len, size });
        }
        Ok(MiniBatches {
            batch: self,
            size,
            shuffle,
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
            order: Vec::new(),
            epochs_left: epochs,
            cursor: len,
        })
    }
}

use rand::SeedableRng;
use rand::seq::SliceRandom;

/// Iterator over mini-batches; see [`Batch::iter_minibatches`].
pub struct MiniBatches<'a> {
    batch: &'a Batch,
    size: usize,
    shuffle: bool,
    rng: rand_chacha::ChaCha8Rng,
    order: Vec<i64>,
    epochs_left: usize,
    cursor: usize,
}

impl Iterator for MiniBatches<'_> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        let len = self.batch.len();
        if self.cursor >= len {
            if self.epochs_left == 0 || len == 0 {
                return None;
            }
            self.epochs_left -= 1;
            self.cursor = 0;
            if self.shuffle {
                self.order = (0..len as i64).collect();
                self.order.shuffle(&mut self.rng);
            }
        }
        let range = self.cursor..self.cursor + self.size;
        self.cursor += self.size;
        Some(if self.shuffle {
            self.batch.reorder(&self.order[range])
        } else {
            self.batch.slice(range)
        })
    }
}

fn check_same_keys<'a>(
    part: usize,
    keys: impl Iterator<Item = &'a String>,
    other: &Batch,
) -> Result<()> {
    for key in keys {
        if !other.contains(key) {
            return Err(Error::KeyMismatch {
                part,
                key: key.clone(),
                problem: "lacks",
            });
        }
    }
    Ok(())
}

fn check_same_keys_rev<'a>(
    part: usize,
    first: &Batch,
    keys: impl Iterator<Item = &'a String>,
) -> Result<()> {
    for key in keys {
        if !first.contains(key) {
            return Err(Error::KeyMismatch {
                part,
                key: key.clone(),
                problem: "has the extra key",
            });
        }
    }
    Ok(())
}

/// Equal shape, dtype and elements; the same storage view counts as equal without reading it.
fn same_tensor(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.size() != b.size() || a.kind() != b.kind() {
        return Ok(false);
    }
    if a.data_ptr() == b.data_ptr() && a.stride() == b.stride() && a.device() == b.device() {
        return Ok(true);
    }
    if a.device() != b.device() {
        return Ok(a.f_equal(&b.f_to_device(a.device())?)?);
    }
    Ok(a.f_equal(b)?)
}

impl fmt::Debug for Batch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "Batch {{ len: {}", self.len())?;
        for (key, t) in &self.tensors {
            writeln!(
                f,
                "  {key:<22} {:?} {:?} {:?}",
                t.size(),
                t.kind(),
                t.device()
            )?;
        }
        for (key, c) in &self.columns {
            let first = c.first().map(|v| {
                let s = v.to_string();
                if s.chars().count() > 40 {
                    format!("{}…", s.chars().take(40).collect::<String>())
                } else {
                    s
                }
            });
            writeln!(
                f,
                "  {key:<22} column[{}] first: {}",
                c.len(),
                first.unwrap_or_default()
            )?;
        }
        if !self.meta_info.is_empty() {
            writeln!(f, "  meta_info: {}", Value::Object(self.meta_info.clone()))?;
        }
        write!(f, "}}")
    }
}

/// Kinds that `save` can write, with their safetensors names.
pub(crate) fn dtype_of(kind: Kind) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as D;
    Some(match kind {
        Kind::Bool => D::BOOL,
        Kind::Uint8 => D::U8,
        Kind::Int8 => D::I8,
        Kind::Int16 => D::I16,
        Kind::Int => D::I32,
        Kind::Int64 => D::I64,
        Kind::Half => D::F16,
        Kind::BFloat16 => D::BF16,
        Kind::Float => D::F32,
        Kind::Double => D::F64,
        _ => return None,
    })
}

pub(crate) fn kind_of_dtype(dtype: safetensors::Dtype) -> Option<Kind> {
    [
        Kind::Bool,
        Kind::Uint8,
        Kind::Int8,
        Kind::Int16,
        Kind::Int,
        Kind::Int64,
        Kind::Half,
        Kind::BFloat16,
        Kind::Float,
        Kind::Double,
    ]
    .into_iter()
    .find(|&k| dtype_of(k) == Some(dtype))
}
