//! Masked sum, mean, variance and whitening with verl's epsilons (`torch_functional.py`).
//!
//! A mask is bool, integer or float and holds only 0 and 1; positions where it is 0 never
//! reach the result, even when they hold NaN or infinity.

use tch::{Kind, Tensor};

use crate::check;
use crate::error::{Error, Result};

/// Masked sum, matching `verl.utils.torch_functional.masked_sum`.
///
/// Sums `values` where `mask` is 1, over `dim` or over everything when `dim` is `None`.
///
/// # Shapes
/// - `values`: any shape, float
/// - `mask`: same shape as `values`; bool, integer or float, binary
/// - returns: `values` reduced over `dim` (a scalar when `dim` is `None`)
pub fn sum(values: &Tensor, mask: &Tensor, dim: Option<i64>) -> Result<Tensor> {
    let mask = checked(values, mask)?;
    check_dim(values, dim)?;
    Ok(sum_(values, &mask, dim))
}

/// Masked mean, matching `verl.utils.torch_functional.masked_mean`:
/// `masked_sum / (mask.sum() + 1e-8)`, so an empty mask gives 0.
///
/// # Shapes
/// - `values`: any shape, float
/// - `mask`: same shape as `values`; bool, integer or float, binary
/// - returns: `values` reduced over `dim` (a scalar when `dim` is `None`)
pub fn mean(values: &Tensor, mask: &Tensor, dim: Option<i64>) -> Result<Tensor> {
    let mask = checked(values, mask)?;
    check_dim(values, dim)?;
    Ok(mean_(values, &mask, dim))
}

/// Masked variance over all elements, matching `verl.utils.torch_functional.masked_var`.
///
/// With `unbiased`, the Bessel correction `n / (n - 1)` is applied and, as in verl, a mask that
/// selects fewer than two elements is an error.
///
/// # Shapes
/// - `values`: any shape, float
/// - `mask`: same shape as `values`; bool, integer or float, binary
/// - returns: a scalar
pub fn var(values: &Tensor, mask: &Tensor, unbiased: bool) -> Result<Tensor> {
    let mask = checked(values, mask)?;
    var_(values, &mask, unbiased)
}

/// Masked whitening, matching `verl.utils.torch_functional.masked_whiten`:
/// `(values - mean) * rsqrt(var + 1e-8)` with the unbiased masked variance; the mean is added
/// back when `shift_mean` is false.
///
/// Masked positions are transformed too (verl's callers multiply by the mask afterwards).
///
/// # Shapes
/// - `values`: any shape, float
/// - `mask`: same shape as `values`; bool, integer or float, binary, at least two ones
/// - returns: same shape as `values`
pub fn whiten(values: &Tensor, mask: &Tensor, shift_mean: bool) -> Result<Tensor> {
    let mask = checked(values, mask)?;
    whiten_(values, &mask, shift_mean)
}

fn checked(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    rl_core::shape::expect_float("values", values)?;
    check::mask("mask", mask, "values", values)
}

fn check_dim(values: &Tensor, dim: Option<i64>) -> Result<()> {
    let rank = values.dim() as i64;
    match dim {
        Some(d) if d >= rank || d < -rank => Err(Error::invalid(
            "dim",
            format!("{d} is out of range for a tensor of rank {rank}"),
        )),
        _ => Ok(()),
    }
}

/// `masked_sum` on checked inputs (mask already in `values`' dtype).
pub(crate) fn sum_(values: &Tensor, mask: &Tensor, dim: Option<i64>) -> Tensor {
    // NaN or inf outside the mask must not leak: select first, then multiply (as verl does).
    let valid = values.where_scalarother(&mask.to_kind(Kind::Bool), 0.0) * mask;
    match dim {
        Some(d) => valid.sum_dim_intlist([d].as_slice(), false, None::<Kind>),
        None => valid.sum(None::<Kind>),
    }
}

/// `masked_mean` on checked inputs.
pub(crate) fn mean_(values: &Tensor, mask: &Tensor, dim: Option<i64>) -> Tensor {
    let count = match dim {
        Some(d) => mask.sum_dim_intlist([d].as_slice(), false, None::<Kind>),
        None => mask.sum(None::<Kind>),
    };
    sum_(values, mask, dim) / (count + 1e-8)
}

/// `masked_var` on checked inputs.
pub(crate) fn var_(values: &Tensor, mask: &Tensor, unbiased: bool) -> Result<Tensor> {
    let mean = mean_(values, mask, None);
    let centered = values - mean;
    let variance = mean_(&centered.square(), mask, None);
    if !unbiased {
        return Ok(variance);
    }
    let mask_sum = mask.sum(None::<Kind>);
    let count = mask_sum.double_value(&[]) as i64;
    if count < 2 {
        let reason = if count == 0 {
            "at least one element in the mask has to be 1"
        } else {
            "the unbiased variance of one element divides by zero; use a larger batch"
        };
        return Err(Error::EmptyMask {
            name: "mask",
            count,
            reason,
        });
    }
    let bessel = &mask_sum / (&mask_sum - 1.0);
    Ok(variance * bessel)
}

/// `masked_whiten` on checked inputs.
pub(crate) fn whiten_(values: &Tensor, mask: &Tensor, shift_mean: bool) -> Result<Tensor> {
    let mean = mean_(values, mask, None);
    let var = var_(values, mask, true)?;
    let whitened = (values - &mean) * (var + 1e-8).rsqrt();
    Ok(if shift_mean {
        whitened
    } else {
        whitened + mean
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64], shape: [i64; 2]) -> Tensor {
        Tensor::from_slice(v).reshape(shape)
    }

    #[test]
    fn mean_ignores_nan_outside_the_mask() {
        let values = t(&[1.0, f64::NAN, 3.0, f64::INFINITY], [2, 2]);
        let mask = t(&[1.0, 0.0, 1.0, 0.0], [2, 2]);
        let m = mean(&values, &mask, None).unwrap().double_value(&[]);
        assert!((m - 2.0).abs() < 1e-7);
        let rows = sum(&values, &mask, Some(1)).unwrap();
        assert_eq!(Vec::<f64>::try_from(&rows).unwrap(), vec![1.0, 3.0]);
    }

    #[test]
    fn var_needs_two_elements() {
        let values = t(&[1.0, 2.0, 3.0, 4.0], [2, 2]);
        let err = var(&values, &t(&[0.0; 4], [2, 2]), true).unwrap_err();
        assert!(err.to_string().contains("selects 0 element(s)"), "{err}");
        let err = var(&values, &t(&[0.0, 1.0, 0.0, 0.0], [2, 2]), true).unwrap_err();
        assert!(matches!(err, Error::EmptyMask { count: 1, .. }));
        assert!(var(&values, &t(&[0.0, 1.0, 0.0, 0.0], [2, 2]), false).is_ok());
    }

    #[test]
    fn bad_masks_are_errors() {
        let values = t(&[1.0, 2.0, 3.0, 4.0], [2, 2]);
        let err = mean(&values, &t(&[0.5, 1.0, 0.0, 0.0], [2, 2]), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`mask` must be binary (0 or 1 everywhere), found 0.5"
        );
        let err = mean(
            &values,
            &Tensor::ones([2, 3], (Kind::Float, tch::Device::Cpu)),
            None,
        );
        assert!(
            err.unwrap_err()
                .to_string()
                .contains("`mask` has shape [2, 3]")
        );
        let bool_mask = t(&[1.0, 0.0, 1.0, 1.0], [2, 2]).to_kind(Kind::Bool);
        assert!(whiten(&values, &bool_mask, true).is_ok());
        assert!(sum(&values, &bool_mask, Some(2)).is_err());
    }
}
