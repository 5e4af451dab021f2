//! The fixture reader and comparisons shared by the parity tests: a family of cases written by
//! `fixtures/generate.py` (tensors in `<family>.safetensors`, parameters and metrics in
//! `<family>.json`), compared within `RTOL`/`ATOL` (or a case's own tolerance).

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use rl_algos::agg::{GlobalBatchInfo, LossAggMode};
use serde_json::Value;
use tch::{Kind, Tensor};

/// Relative tolerance of every comparison (f64 inputs).
pub(crate) const RTOL: f64 = 1e-6;
/// Absolute tolerance, for entries that are zero or nearly so.
pub(crate) const ATOL: f64 = 1e-9;

pub(crate) struct Family {
    pub(crate) name: &'static str,
    pub(crate) tensors: HashMap<String, Tensor>,
    pub(crate) cases: Vec<Value>,
}

impl Family {
    pub(crate) fn load(name: &'static str) -> Family {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let tensors = Tensor::read_safetensors(dir.join(format!("{name}.safetensors")))
            .unwrap_or_else(|e| panic!("reading {name}.safetensors: {e}"))
            .into_iter()
            .collect();
        let json: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        let cases = json["cases"].as_array().unwrap().clone();
        assert!(!cases.is_empty());
        Family {
            name,
            tensors,
            cases,
        }
    }

    pub(crate) fn cases(&self) -> impl Iterator<Item = Case<'_>> {
        self.cases.iter().map(move |c| Case {
            family: self,
            json: c,
            name: c["name"].as_str().unwrap(),
        })
    }
}

pub(crate) struct Case<'a> {
    pub(crate) family: &'a Family,
    pub(crate) json: &'a Value,
    pub(crate) name: &'a str,
}

impl Case<'_> {
    pub(crate) fn func(&self) -> &str {
        self.json["fn"].as_str().unwrap()
    }

    pub(crate) fn t(&self, key: &str) -> Tensor {
        let k = format!("{}/{key}", self.name);
        self.family
            .tensors
            .get(&k)
            .unwrap_or_else(|| panic!("{}: no tensor {k}", self.family.name))
            .shallow_clone()
    }

    pub(crate) fn has(&self, key: &str) -> bool {
        self.family
            .tensors
            .contains_key(&format!("{}/{key}", self.name))
    }

    pub(crate) fn p(&self, key: &str) -> &Value {
        &self.json["params"][key]
    }

    pub(crate) fn f(&self, key: &str) -> f64 {
        self.p(key)
            .as_f64()
            .unwrap_or_else(|| panic!("{}: no param {key}", self.name))
    }

    pub(crate) fn metric(&self, key: &str) -> f64 {
        self.json["metrics"][key]
            .as_f64()
            .unwrap_or_else(|| panic!("{}: no metric {key}", self.name))
    }

    pub(crate) fn close(&self, what: &str, got: &Tensor, want: &Tensor) {
        let ctx = format!("{}/{}: {what}", self.family.name, self.name);
        close(&ctx, got, want);
    }

    pub(crate) fn close_key(&self, key: &str, got: &Tensor) {
        self.close(key, got, &self.t(key));
    }

    pub(crate) fn close_f(&self, what: &str, got: f64, want: f64) {
        let ok = (got - want).abs() <= ATOL + RTOL * want.abs();
        assert!(
            ok,
            "{}/{}: {what}: got {got}, want {want}",
            self.family.name, self.name
        );
    }
}

pub(crate) fn close(ctx: &str, got: &Tensor, want: &Tensor) {
    close_within(ctx, got, want, RTOL, ATOL);
}

/// [`close`] with the given tolerances.
pub(crate) fn close_within(ctx: &str, got: &Tensor, want: &Tensor, rtol: f64, atol: f64) {
    assert_eq!(got.size(), want.size(), "{ctx}: shape");
    let got = got.detach().to_kind(Kind::Double);
    let want = want.to_kind(Kind::Double);
    let diff = (&got - &want).abs();
    let bound = want.abs() * rtol + atol;
    let bad = diff.gt_tensor(&bound);
    if bad.any().int64_value(&[]) != 0 {
        let i = bad.reshape([-1]).nonzero().int64_value(&[0, 0]);
        let (g, w) = (
            got.reshape([-1]).double_value(&[i]),
            want.reshape([-1]).double_value(&[i]),
        );
        panic!("{ctx}: flat index {i}: got {g}, want {w}\ngot  {got}\nwant {want}");
    }
}

pub(crate) fn leaf(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

pub(crate) fn mode(s: &str) -> LossAggMode {
    s.parse().unwrap()
}

pub(crate) fn batch_info(v: &Value) -> GlobalBatchInfo {
    if v.is_null() || v.as_object().is_some_and(|o| o.is_empty()) {
        return GlobalBatchInfo::local();
    }
    GlobalBatchInfo {
        dp_size: v["dp_size"].as_i64().unwrap(),
        batch_num_tokens: v["batch_num_tokens"].as_f64(),
        global_batch_size: v["global_batch_size"].as_f64(),
        loss_scale_factor: v["loss_scale_factor"].as_f64(),
    }
}

/// Compares a metric map with a case's `metrics` object: the same keys (after stripping
/// `strip` from ours), each value within tolerance (NaN equals NaN, infinities must match).
pub(crate) fn same_metrics<'k>(
    c: &Case<'_>,
    got: impl IntoIterator<Item = (&'k str, f64)>,
    strip: &str,
) {
    let want = c.json["metrics"].as_object().unwrap();
    let got: HashMap<String, f64> = got
        .into_iter()
        .map(|(k, v)| (k.trim_start_matches(strip).to_owned(), v))
        .collect();
    let mut missing: Vec<&String> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    let mut extra: Vec<&String> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    missing.sort();
    extra.sort();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{}/{}: metric keys differ: missing {missing:?}, extra {extra:?}",
        c.family.name,
        c.name
    );
    for (k, w) in want {
        let w = w.as_f64().unwrap_or(f64::NAN);
        let g = got[k];
        if w.is_nan() && g.is_nan() || w == g {
            continue;
        }
        c.close_f(k, g, w);
    }
}
