//! Attention over packed rows computed block by block (verl's `use_remove_padding` and
//! `use_prefix_grouper` layouts), instead of densely over a row's whole width under a mask.
//!
//! A packed row holds whole sequences one after another. A *root* sequence attends causally to
//! itself only; an *extension* (a response whose prompt is shared with its group) attends to
//! all of its root's tokens and causally to itself. The dense form computes every query against
//! every key of the row and masks most of it away: a shared prompt followed by its 8 responses
//! is a row of about a thousand tokens whose scores are nine tenths masked. Here each root's
//! tokens are gathered into a block of their own, each extension's queries meet its root's keys
//! and its own only, and the outputs are put back in the packed order: the same attention up to
//! float rounding (the tests below), with the work of the blocks that are real.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// How a stack's layers mask their attention.
#[derive(Debug)]
pub(crate) enum Mask {
    /// `[batch, 1, seq_len, kv_len]`: bool (true = may attend), or its additive float form.
    Dense(Tensor),
    /// Packed rows of root sequences and their extensions, attended block by block.
    Blocks(Box<Blocks>),
}

impl Mask {
    pub(crate) fn shallow_clone(&self) -> Mask {
        match self {
            Mask::Dense(t) => Mask::Dense(t.shallow_clone()),
            Mask::Blocks(b) => Mask::Blocks(Box::new(b.shallow_clone())),
        }
    }
}

/// Where the sequences of packed `[rows, width]` rows sit, as gathers into per-sequence blocks.
#[derive(Debug)]
pub(crate) struct Blocks {
    /// Flat indices (`row * width + column`) of each root's tokens in order, right-padded to
    /// `root_len` (padding reads index 0): `[roots * root_len]`.
    root_idx: Tensor,
    roots: i64,
    root_len: i64,
    /// The same for the extensions: `[exts * ext_len]`.
    ext_idx: Tensor,
    exts: i64,
    ext_len: i64,
    /// Per extension, its root's block: `[exts]`.
    ext_root: Tensor,
    /// `[roots, 1, root_len, root_len]`: causal over the root's real tokens, and every query
    /// sees itself (so the blocks' padding stays finite).
    root_mask: Tensor,
    /// `[exts, 1, ext_len, root_len + ext_len]`: the root's real tokens, then causal over the
    /// extension's own, and every query itself.
    ext_mask: Tensor,
    /// Per flat position, its row in the roots' outputs followed by the extensions'
    /// (`[rows * width]`); padding reads row 0 (it is never read back).
    back: Tensor,
}

/// One sequence of the packed rows: its flat positions and the segment it extends (0: none).
struct Sequence {
    at: Vec<i64>,
    prefix: i64,
}

impl Blocks {
    fn shallow_clone(&self) -> Blocks {
        Blocks {
            root_idx: self.root_idx.shallow_clone(),
            ext_idx: self.ext_idx.shallow_clone(),
            ext_root: self.ext_root.shallow_clone(),
            root_mask: self.root_mask.shallow_clone(),
            ext_mask: self.ext_mask.shallow_clone(),
            back: self.back.shallow_clone(),
            ..*self
        }
    }

    /// The blocks of packed rows (see [`Model::forward_packed`](crate::Model::forward_packed)
    /// for `segment_ids` and `prefix_ids`), their masks boolean or, for a float32 stack on the
    /// CPU, additive (as the dense path's); `None` when the rows hold no real token. A
    /// sequence that is not contiguous, names different prefixes, or extends a sequence that is
    /// not a root placed before it in the same row is an error.
    pub(crate) fn new(
        segment_ids: &Tensor,
        prefix_ids: &Tensor,
        stack: Kind,
        device: Device,
    ) -> Result<Option<Blocks>> {
        let width = segment_ids.size()[1] as usize;
        let flat = |t: &Tensor| Vec::<i64>::try_from(t.to_device(Device::Cpu).reshape([-1]));
        let (seg, pre) = (flat(segment_ids)?, flat(prefix_ids)?);
        // sequences in order of their first token
        let mut seqs: Vec<Sequence> = Vec::new();
        let mut index: std::collections::HashMap<i64, usize> = std::collections::HashMap::new();
        let mut row_of: Vec<usize> = Vec::new();
        for (p, (&s, &x)) in seg.iter().zip(&pre).enumerate() {
            if s == 0 {
                continue;
            }
            let i = *index.entry(s).or_insert_with(|| {
                seqs.push(Sequence {
                    at: Vec::new(),
                    prefix: x,
                });
                row_of.push(p / width);
                seqs.len() - 1
            });
            let q = &mut seqs[i];
            if q.prefix != x {
                return Err(Error::invalid(
                    "prefix_ids",
                    format!("segment {s} names prefixes {} and {x}", q.prefix),
                ));
            }
            if q.at.last().is_some_and(|&last| last as usize + 1 != p) || row_of[i] != p / width {
                return Err(Error::invalid(
                    "segment_ids",
                    format!("segment {s} is not contiguous in its row (position {p})"),
                ));
            }
            q.at.push(p as i64);
        }
        if seqs.is_empty() {
            return Ok(None);
        }
        // roots get blocks in order; an extension names its root's block
        let mut root_block = std::collections::HashMap::new();
        let (mut roots, mut exts) = (Vec::new(), Vec::new());
        for (i, q) in seqs.iter().enumerate() {
            if q.prefix == 0 {
                root_block.insert(seg[q.at[0] as usize], roots.len() as i64);
                roots.push(i);
            }
        }
        let mut ext_root = Vec::new();
        for (i, q) in seqs.iter().enumerate() {
            if q.prefix == 0 {
                continue;
            }
            let placed = index.get(&q.prefix).map(|&r| &seqs[r]);
            let block = match (placed, root_block.get(&q.prefix)) {
                (Some(r), Some(&b))
                    if row_of[index[&q.prefix]] == row_of[i] && r.at[0] < q.at[0] =>
                {
                    b
                }
                _ => {
                    return Err(Error::invalid(
                        "prefix_ids",
                        format!(
                            "segment {} extends segment {}, which is not a root sequence placed before it in its row",
                            seg[q.at[0] as usize], q.prefix
                        ),
                    ));
                }
            };
            ext_root.push(block);
            exts.push(i);
        }
        let longest = |ids: &[usize]| ids.iter().map(|&i| seqs[i].at.len()).max().unwrap_or(0);
        let (root_len, ext_len) = (longest(&roots), longest(&exts));
        let gather = |ids: &[usize], len: usize| -> Vec<i64> {
            let mut out = vec![0i64; ids.len() * len];
            for (b, &i) in ids.iter().enumerate() {
                out[b * len..b * len + seqs[i].at.len()].copy_from_slice(&seqs[i].at);
            }
            out
        };
        let mut back = vec![0i64; seg.len()];
        for (b, &i) in roots.iter().enumerate() {
            for (t, &p) in seqs[i].at.iter().enumerate() {
                back[p as usize] = (b * root_len + t) as i64;
            }
        }
        let base = roots.len() * root_len;
        for (b, &i) in exts.iter().enumerate() {
            for (t, &p) in seqs[i].at.iter().enumerate() {
                back[p as usize] = (base + b * ext_len + t) as i64;
            }
        }
        // masks: true = may attend
        let mut root_mask = vec![false; roots.len() * root_len * root_len];
        for (b, &i) in roots.iter().enumerate() {
            let n = seqs[i].at.len();
            for q in 0..root_len {
                let row = &mut root_mask[(b * root_len + q) * root_len..][..root_len];
                for (k, seen) in row.iter_mut().enumerate() {
                    *seen = (k <= q && k < n) || k == q;
                }
            }
        }
        let keys = root_len + ext_len;
        let mut ext_mask = vec![false; exts.len() * ext_len * keys];
        for (b, (&i, &r)) in exts.iter().zip(&ext_root).enumerate() {
            let (n, root_n) = (seqs[i].at.len(), seqs[roots[r as usize]].at.len());
            for q in 0..ext_len {
                let row = &mut ext_mask[(b * ext_len + q) * keys..][..keys];
                for (k, seen) in row.iter_mut().enumerate() {
                    *seen = if k < root_len {
                        k < root_n
                    } else {
                        let k = k - root_len;
                        (k <= q && k < n) || k == q
                    };
                }
            }
        }
        // the additive form where the dense path uses one (`sdpa_mask`'s rule and conversion)
        let mask = |m: Vec<bool>, shape: [usize; 4]| {
            let t = Tensor::from_slice(&m)
                .view(shape.map(|d| d as i64))
                .to_device(device);
            crate::model::sdpa_mask(&t, shape[2] as i64, stack).unwrap_or(t)
        };
        let ints = |v: Vec<i64>| Tensor::from_slice(&v).to_device(device);
        Ok(Some(Blocks {
            root_idx: ints(gather(&roots, root_len)),
            roots: roots.len() as i64,
            root_len: root_len as i64,
            ext_idx: ints(gather(&exts, ext_len)),
            exts: exts.len() as i64,
            ext_len: ext_len as i64,
            ext_root: ints(ext_root),
            root_mask: mask(root_mask, [roots.len(), 1, root_len, root_len]),
            ext_mask: mask(ext_mask, [exts.len(), 1, ext_len, keys]),
            back: ints(back),
        }))
    }

    /// The attention of the packed rows' queries over their keys and values, block by block
    /// (query head `h` reads key head `h / (n_heads / n_kv_heads)`), in `[batch, seq_len,
    /// n_heads * head_dim]`, the layout the output projection reads.
    ///
    /// # Shapes
    /// - `q`: `[batch, n_heads, seq_len, head_dim]`; `k`, `v`: `[batch, n_kv_heads, seq_len,
    ///   head_dim]`, where `batch * seq_len` is the rows' `rows * width`
    pub(crate) fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let (b, nh, s, hd) = q.size4().expect("q is [batch, heads, seq_len, head_dim]");
        let nkv = k.size()[1];
        let gqa = nh != nkv;
        // [batch, heads, seq_len, head_dim] -> [batch * seq_len, heads * head_dim]
        let flat = |t: &Tensor, n: i64| t.transpose(1, 2).reshape([b * s, n * hd]);
        let (q, k, v) = (flat(q, nh), flat(k, nkv), flat(v, nkv));
        // -> [blocks, heads, len, head_dim]
        let block = |t: &Tensor, idx: &Tensor, count: i64, len: i64, n: i64| {
            t.index_select(0, idx)
                .view([count, len, n, hd])
                .transpose(1, 2)
        };
        let sdpa = |q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, count: i64, len: i64| {
            crate::attention::sdpa(q, k, v, mask, gqa)
                .transpose(1, 2)
                .reshape([count * len, nh * hd])
        };
        let (r, rl) = (self.roots, self.root_len);
        let rk = block(&k, &self.root_idx, r, rl, nkv);
        let rv = block(&v, &self.root_idx, r, rl, nkv);
        let rq = block(&q, &self.root_idx, r, rl, nh);
        let mut outs = vec![sdpa(&rq, &rk, &rv, &self.root_mask, r, rl)];
        if self.exts > 0 {
            let (e, el) = (self.exts, self.ext_len);
            let with_root = |own: Tensor, root: &Tensor| {
                Tensor::cat(&[root.index_select(0, &self.ext_root), own], 2)
            };
            let ek = with_root(block(&k, &self.ext_idx, e, el, nkv), &rk);
            let ev = with_root(block(&v, &self.ext_idx, e, el, nkv), &rv);
            let eq = block(&q, &self.ext_idx, e, el, nh);
            outs.push(sdpa(&eq, &ek, &ev, &self.ext_mask, e, el));
        }
        Tensor::cat(&outs, 0)
            .index_select(0, &self.back)
            .view([b, s, nh * hd])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dense form of the same rows: a query sees the keys up to itself of its own
    /// sequence and all of the prefix's, and always itself.
    fn dense_mask(seg: &[i64], pre: &[i64], rows: i64, width: i64) -> Tensor {
        let (w, mut m) = (width as usize, vec![false; seg.len() * width as usize]);
        for r in 0..rows as usize {
            for q in 0..w {
                for k in 0..w {
                    let (sq, sk) = (seg[r * w + q], seg[r * w + k]);
                    let same = sq != 0 && (sk == sq || sk == pre[r * w + q]);
                    m[(r * w + q) * w + k] = (same && k <= q) || k == q;
                }
            }
        }
        Tensor::from_slice(&m).view([rows, 1, width, width])
    }

    /// Rows packed as the prefix grouper packs them (a prompt, then responses naming it) and as
    /// remove-padding does (sequences of their own), with tail padding: the blocks' outputs
    /// and gradients equal the dense masked attention's at every real position, with grouped
    /// heads (3 query heads a key head, as SmolLM2) and without.
    #[test]
    fn blocks_equal_the_dense_masked_attention() {
        let _generator = crate::hold_generator();
        // row 0: prompt 1 (3 tokens), responses 2 and 3 (2 and 3 tokens), a plain sequence 4
        // (2 tokens), padding; row 1: prompt 5 (4 tokens), response 6 (1 token), padding
        #[rustfmt::skip]
        let seg = [
            1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 0,
            5, 5, 5, 5, 6, 0, 0, 0, 0, 0, 0,
        ];
        #[rustfmt::skip]
        let pre = [
            0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0,
            0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0,
        ];
        let (rows, width) = (2, 11);
        let ids = |v: &[i64]| Tensor::from_slice(v).view([rows, width]);
        for (nh, nkv) in [(6, 2), (4, 4)] {
            // float32 takes the additive masks, float64 the boolean ones
            for (stack, tol) in [(Kind::Float, 1e-5), (Kind::Double, 1e-10)] {
                let blocks = Blocks::new(&ids(&seg), &ids(&pre), stack, Device::Cpu)
                    .unwrap()
                    .expect("real tokens");
                let dense = dense_mask(&seg, &pre, rows, width);
                tch::manual_seed(11);
                let (hd, opts) = (8, (stack, Device::Cpu));
                let q = Tensor::randn([rows, nh, width, hd], opts);
                let k = Tensor::randn([rows, nkv, width, hd], opts);
                let v = Tensor::randn([rows, nkv, width, hd], opts);
                let weights = Tensor::randn([rows, width, nh * hd], opts);
                let real = ids(&seg).ne(0).view([rows, width, 1]);
                // the output at real positions, and the gradients of a weighted sum of it
                let run = |attend: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Tensor| {
                    let [q, k, v] = [&q, &k, &v].map(|t| t.copy().set_requires_grad(true));
                    let out = attend(&q, &k, &v);
                    let out = out.where_self(&real, &out.zeros_like());
                    (&out * &weights).sum(stack).backward();
                    (out.detach(), [q.grad(), k.grad(), v.grad()])
                };
                let got = run(&|q, k, v| blocks.attend(q, k, v));
                let want = run(&|q, k, v| {
                    crate::attention::sdpa(q, k, v, &dense, nh != nkv)
                        .transpose(1, 2)
                        .reshape([rows, width, nh * hd])
                });
                let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
                let d = diff(&got.0, &want.0);
                assert!(d < tol, "heads {nh}/{nkv} {stack:?}: outputs differ by {d}");
                for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
                    let d = diff(&got.1[i], &want.1[i]);
                    assert!(d < tol, "heads {nh}/{nkv} {stack:?}: {name} differs by {d}");
                }
            }
        }
    }

    /// Sequences the dense mask could not mean are refused, naming the key at fault.
    #[test]
    fn malformed_layouts_are_refused() {
        let t = |v: &[i64], rows: i64| Tensor::from_slice(v).view([rows, -1]);
        // (segment ids, prefix ids, rows, the key the error names)
        let cases: [(&[i64], &[i64], i64, &str); 5] = [
            // a response naming a segment that is not there
            (&[1, 1, 2, 2], &[0, 0, 9, 9], 1, "prefix_ids"),
            // a response placed before its prompt
            (&[2, 2, 1, 1], &[1, 1, 0, 0], 1, "prefix_ids"),
            // a segment split in two
            (&[1, 2, 1, 0], &[0, 0, 0, 0], 1, "segment_ids"),
            // a segment running on into the next row
            (&[0, 1, 1, 2], &[0, 0, 0, 0], 2, "segment_ids"),
            // two prefixes in one segment
            (&[1, 1, 2, 2], &[0, 0, 1, 0], 1, "prefix_ids"),
        ];
        for (seg, pre, rows, key) in cases {
            let err = Blocks::new(&t(seg, rows), &t(pre, rows), Kind::Float, Device::Cpu)
                .expect_err("a malformed layout")
                .to_string();
            assert!(err.contains(key), "{seg:?}/{pre:?}: {err}");
        }
        let none = Blocks::new(&t(&[0, 0], 1), &t(&[0, 0], 1), Kind::Float, Device::Cpu).unwrap();
        assert!(none.is_none(), "no real token, no blocks");
    }
}
