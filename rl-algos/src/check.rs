//! Input checks shared by the public entry points: float values, binary masks, group ids.

use rl_core::shape::{self, Dim};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// Checks that `t` is a float tensor of exactly the dims given.
pub(crate) fn float(name: &str, t: &Tensor, dims: &[Dim]) -> Result<Vec<i64>> {
    let size = shape::expect_dims(name, t, dims)?;
    shape::expect_float(name, t)?;
    Ok(size)
}

/// Checks that `t` is a float tensor of the same shape as `like`.
pub(crate) fn float_like(name: &str, t: &Tensor, like_name: &str, like: &Tensor) -> Result<()> {
    shape::expect_same_shape(name, t, like_name, like)?;
    shape::expect_float(name, t)?;
    Ok(())
}

/// Checks that `mask` has the shape of `like`, is bool, integer or float, and holds only 0 and 1;
/// returns it converted to `like`'s dtype so the arithmetic below runs in one dtype.
pub(crate) fn mask(
    name: &'static str,
    mask: &Tensor,
    like_name: &str,
    like: &Tensor,
) -> Result<Tensor> {
    shape::expect_same_shape(name, mask, like_name, like)?;
    binary(name, mask)?;
    Ok(mask.to_kind(like.kind()))
}

/// Checks that `mask` is bool, integer or float and holds only 0 and 1.
pub(crate) fn binary(name: &'static str, mask: &Tensor) -> Result<()> {
    match mask.kind() {
        Kind::Bool => return Ok(()),
        Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64 => {}
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16 => {}
        _ => shape::expect_kind(
            name,
            mask,
            &[Kind::Bool, Kind::Int64, Kind::Float, Kind::Double],
        )?,
    }
    let bad = mask.ne(0).logical_and(&mask.ne(1));
    if bad.any().int64_value(&[]) != 0 {
        let value = mask.masked_select(&bad).double_value(&[0]);
        return Err(Error::NonBinaryMask { name, value });
    }
    Ok(())
}

/// Dense group ids for a batch: `inv[i]` in `0..n` is the group of row `i`.
pub(crate) struct Groups {
    /// `[batch]` int64, the dense group of each row.
    pub(crate) inv: Tensor,
    /// `[n]` in the values' float dtype, the size of each group.
    pub(crate) counts: Tensor,
    /// The number of distinct groups.
    pub(crate) n: i64,
    /// `[batch]` int64, the place of each row within its group (`0..size`).
    pub(crate) pos: Tensor,
    /// The size of the largest group.
    pub(crate) width: i64,
}

impl Groups {
    /// Per-group sums of `x` over its rows (`[batch, ...]` -> `[n, ...]`).
    pub(crate) fn sum(&self, x: &Tensor) -> Tensor {
        let mut size = x.size();
        size[0] = self.n;
        Tensor::zeros(size.as_slice(), (x.kind(), x.device())).index_add(0, &self.inv, x)
    }

    /// Broadcasts a per-group value back to the rows (`[n]` -> `[batch]`).
    pub(crate) fn rows(&self, per_group: &Tensor) -> Tensor {
        per_group.index_select(0, &self.inv)
    }

    /// Lays a per-row tensor out as `[n, width]`, one group per row, padded with `fill`; for
    /// per-group maxima and minima without a loop over rows.
    pub(crate) fn padded(&self, x: &Tensor, fill: f64) -> Tensor {
        let out = Tensor::full([self.n, self.width], fill, (x.kind(), x.device()));
        out.index_put(&[Some(&self.inv), Some(&self.pos)], x, false)
    }

    /// Per-group maxima (`[batch]` -> `[n]`).
    pub(crate) fn max(&self, x: &Tensor) -> Tensor {
        self.padded(x, f64::NEG_INFINITY)
            .amax([1].as_slice(), false)
    }

    /// Per-group minima (`[batch]` -> `[n]`).
    pub(crate) fn min(&self, x: &Tensor) -> Tensor {
        self.padded(x, f64::INFINITY).amin([1].as_slice(), false)
    }

    /// Per-group means and unbiased standard deviations, like `torch.mean` / `torch.std` over each
    /// group; singleton groups get NaN std (callers replace it as verl does).
    pub(crate) fn mean_std(&self, x: &Tensor) -> (Tensor, Tensor) {
        let mean = self.sum(x) / &self.counts;
        let centered = x - self.rows(&mean);
        let var = self.sum(&centered.square()) / (&self.counts - 1.0);
        (mean, var.sqrt())
    }
}

/// Checks a `[batch]` tensor of integer group ids and densifies it.
pub(crate) fn groups(name: &str, index: &Tensor, batch: i64, kind: Kind) -> Result<Groups> {
    shape::expect_dims(name, index, &[Dim::Is(batch)])?;
    shape::expect_kind(
        name,
        index,
        &[Kind::Int64, Kind::Int, Kind::Int16, Kind::Int8, Kind::Uint8],
    )?;
    let (_, inv, counts) = index
        .to_kind(Kind::Int64)
        .internal_unique2(true, true, true);
    let inv = inv.reshape([batch]);
    let n = counts.size()[0];
    let width = if n > 0 {
        counts.max().int64_value(&[])
    } else {
        0
    };
    // place within the group: rank among the group's rows, in batch order
    let (sorted, order) = inv.sort_stable(true, 0, false);
    let starts = counts.cumsum(0, Kind::Int64) - &counts;
    let rows = Tensor::arange(batch, (Kind::Int64, index.device()));
    let pos_sorted = rows - starts.index_select(0, &sorted);
    let pos =
        Tensor::zeros([batch], (Kind::Int64, index.device())).index_copy(0, &order, &pos_sorted);
    Ok(Groups {
        inv,
        counts: counts.to_kind(kind),
        n,
        pos,
        width,
    })
}
