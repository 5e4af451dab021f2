//! Shape and dtype checks for the `# Shapes` sections of public functions, returning [`Error`]s
//! that name the argument, so a doc's promise is checked on every call.

use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// One expected dimension: a fixed size, or any size bound to a name for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// Exactly this size.
    Is(i64),
    /// Any size; the name is only used in messages (`"batch"`, `"response_len"`).
    Any(&'static str),
}

fn render(dims: &[Dim]) -> String {
    let parts: Vec<String> = dims
        .iter()
        .map(|d| match d {
            Dim::Is(n) => n.to_string(),
            Dim::Any(name) => (*name).to_owned(),
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Checks that `t` has exactly `dims.len()` dimensions matching `dims`; returns its size.
///
/// # Shapes
/// - `t`: any tensor; checked against `dims`
pub fn expect_dims(name: &str, t: &Tensor, dims: &[Dim]) -> Result<Vec<i64>> {
    let got = t.size();
    let ok = got.len() == dims.len()
        && got.iter().zip(dims).all(|(g, d)| match d {
            Dim::Is(n) => g == n,
            Dim::Any(_) => true,
        });
    if ok {
        Ok(got)
    } else {
        Err(Error::Shape {
            key: name.to_owned(),
            expected: render(dims),
            got,
        })
    }
}

/// Checks that `t` has the same shape as `reference` (named `ref_name` in the message).
///
/// # Shapes
/// - `t`, `reference`: any tensors of one shape
pub fn expect_same_shape(name: &str, t: &Tensor, ref_name: &str, reference: &Tensor) -> Result<()> {
    let (got, want) = (t.size(), reference.size());
    if got == want {
        Ok(())
    } else {
        Err(Error::Shape {
            key: name.to_owned(),
            expected: format!("{want:?} (as `{ref_name}`)"),
            got,
        })
    }
}

/// Checks that `t` is a 2-d matrix and returns `(rows, cols)`.
///
/// # Shapes
/// - `t`: `[rows, cols]`
pub fn expect_2d(name: &str, t: &Tensor) -> Result<(i64, i64)> {
    let s = expect_dims(name, t, &[Dim::Any("rows"), Dim::Any("cols")])?;
    Ok((s[0], s[1]))
}

/// Checks that `t` has one of the `allowed` dtypes.
pub fn expect_kind(name: &str, t: &Tensor, allowed: &[Kind]) -> Result<()> {
    let got = t.kind();
    if allowed.contains(&got) {
        Ok(())
    } else {
        let expected: Vec<String> = allowed.iter().map(|k| format!("{k:?}")).collect();
        Err(Error::Dtype {
            key: name.to_owned(),
            expected: expected.join(" or "),
            got,
        })
    }
}

/// Checks that `t` is floating point (f16, bf16, f32 or f64).
pub fn expect_float(name: &str, t: &Tensor) -> Result<()> {
    expect_kind(
        name,
        t,
        &[Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_mismatch_names_the_argument_and_shape() {
        let t = Tensor::zeros([2, 3], (Kind::Float, tch::Device::Cpu));
        let err = expect_dims("response_mask", &t, &[Dim::Any("batch"), Dim::Is(4)]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`response_mask` has shape [2, 3], expected [batch, 4]"
        );
        assert_eq!(
            expect_dims("x", &t, &[Dim::Any("batch"), Dim::Is(3)]).unwrap(),
            vec![2, 3]
        );
        let err = expect_2d("x", &Tensor::zeros([2], (Kind::Float, tch::Device::Cpu))).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }));
    }

    #[test]
    fn same_shape_and_kind_checks() {
        let a = Tensor::zeros([2, 3], (Kind::Float, tch::Device::Cpu));
        let b = Tensor::zeros([3, 2], (Kind::Int64, tch::Device::Cpu));
        let err = expect_same_shape("values", &a, "response_mask", &b).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`values` has shape [2, 3], expected [3, 2] (as `response_mask`)"
        );
        assert!(expect_same_shape("a", &a, "a", &a).is_ok());
        let err = expect_float("advantages", &b).unwrap_err();
        assert!(err.to_string().contains("`advantages` has dtype Int64"));
        assert!(expect_float("a", &a).is_ok());
    }
}
