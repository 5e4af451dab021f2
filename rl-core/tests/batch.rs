//! Properties and error paths of `Batch`, through its public API.

use proptest::prelude::*;
use rl_core::{Batch, Error, keys};
use serde_json::{Value, json};
use tch::{Device, Kind, Tensor};

/// A batch of `len` rows with f32, bf16, i64 and bool tensors, a string and a JSON column.
/// Values are a pure function of `(len, width, seed)`: tests run in parallel threads, so the
/// global torch RNG is off limits.
fn make_batch(len: usize, width: i64, seed: i64) -> Batch {
    let n = len as i64;
    let opts = (Kind::Float, Device::Cpu);
    let grid = |w: i64| Tensor::arange(n * w, opts).view([n, w]);
    let s = seed as f64 + 1.0;
    let mut b = Batch::new();
    b.insert(keys::OLD_LOG_PROBS, (grid(width) * s * 0.37).sin())
        .unwrap();
    b.insert(
        keys::VALUES,
        (grid(width) * s * 0.11).cos().to_kind(Kind::BFloat16),
    )
    .unwrap();
    b.insert(
        keys::INPUT_IDS,
        (grid(width + 1) * (seed + 7) as f64)
            .fmod(1000.0)
            .to_kind(Kind::Int64),
    )
    .unwrap();
    b.insert("done", (Tensor::arange(n, opts) * s).fmod(3.0).eq(0.0))
        .unwrap();
    b.insert_column(
        keys::UID,
        (0..len).map(|i| json!(format!("uid-{seed}-{i}"))).collect(),
    )
    .unwrap();
    b.insert_column(
        keys::EXTRA_INFO,
        (0..len)
            .map(|i| json!({"index": i, "split": "train"}))
            .collect(),
    )
    .unwrap();
    b.meta_info_mut().insert("temperature".into(), json!(0.7));
    b
}

/// Bit-exact equality of two batches: same keys, shapes, dtypes, elements, columns and meta.
fn assert_same(a: &Batch, b: &Batch) {
    assert_eq!(
        a.tensor_keys().collect::<Vec<_>>(),
        b.tensor_keys().collect::<Vec<_>>()
    );
    assert_eq!(
        a.column_keys().collect::<Vec<_>>(),
        b.column_keys().collect::<Vec<_>>()
    );
    for k in a.tensor_keys() {
        let (x, y) = (a.get(k).unwrap(), b.get(k).unwrap());
        assert_eq!(x.kind(), y.kind(), "dtype of {k}");
        assert_eq!(x.size(), y.size(), "shape of {k}");
        // Compare bit patterns so that NaN payloads and -0.0 count too.
        let bits = |t: &Tensor| {
            let t = t.contiguous();
            let mut v = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
            t.copy_data_u8(&mut v, t.numel());
            v
        };
        assert_eq!(bits(x), bits(y), "elements of {k}");
    }
    for k in a.column_keys() {
        assert_eq!(a.column(k).unwrap(), b.column(k).unwrap(), "column {k}");
    }
    assert_eq!(a.meta_info(), b.meta_info());
}

fn uids(b: &Batch) -> Vec<Value> {
    b.column(keys::UID).unwrap().to_vec()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn concat_of_chunks_is_identity(k in 1usize..5, n in 1usize..5, width in 1i64..4, seed in 0i64..1000) {
        let b = make_batch(k * n, width, seed);
        let parts = b.chunk(n).unwrap();
        prop_assert_eq!(parts.len(), n);
        assert_same(&Batch::concat(&parts).unwrap(), &b);
    }

    #[test]
    fn concat_of_splits_is_identity(len in 1usize..13, size in 1usize..6, seed in 0i64..1000) {
        let b = make_batch(len, 2, seed);
        let parts = b.split(size).unwrap();
        prop_assert_eq!(parts.len(), len.div_ceil(size));
        prop_assert!(parts.iter().all(|p| p.len() <= size));
        assert_same(&Batch::concat(&parts).unwrap(), &b);
    }

    #[test]
    fn interleaved_repeat_then_every_nth_row_is_identity(len in 1usize..9, n in 1usize..5, seed in 0i64..1000) {
        let b = make_batch(len, 3, seed);
        let r = b.repeat(n, true).unwrap();
        prop_assert_eq!(r.len(), len * n);
        for offset in 0..n {
            let every_nth: Vec<i64> = (0..len).map(|i| (i * n + offset) as i64).collect();
            assert_same(&r.reorder(&every_nth).unwrap(), &b);
        }
        // Not interleaved: the batch n times in a row.
        let tiled = b.repeat(n, false).unwrap();
        for copy in tiled.chunk(n).unwrap() {
            assert_same(&copy, &b);
        }
    }

    #[test]
    fn reorder_then_inverse_is_identity(perm in (1usize..12).prop_flat_map(|n| Just((0..n as i64).collect::<Vec<_>>()).prop_shuffle()), seed in 0i64..1000) {
        let b = make_batch(perm.len(), 2, seed);
        let mut inverse = vec![0i64; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p as usize] = i as i64;
        }
        assert_same(&b.reorder(&perm).unwrap().reorder(&inverse).unwrap(), &b);
    }

    #[test]
    fn pad_to_divisor_then_unpad_is_identity(len in 1usize..12, divisor in 1usize..30, seed in 0i64..1000) {
        let b = make_batch(len, 2, seed);
        let (padded, pad) = b.pad_to_divisor(divisor).unwrap();
        prop_assert_eq!(padded.len() % divisor, 0);
        prop_assert_eq!(padded.len(), len + pad);
        prop_assert!(pad < divisor);
        // Padding rows are copies of the leading rows, cycling when the pad exceeds the batch.
        let pad_uids = uids(&padded)[len..].to_vec();
        let expect: Vec<Value> = (0..pad).map(|i| uids(&b)[i % len].clone()).collect();
        prop_assert_eq!(pad_uids, expect);
        assert_same(&padded.unpad(pad).unwrap(), &b);
    }

    #[test]
    fn save_load_round_trip_is_bit_exact(len in 1usize..8, width in 1i64..5, seed in 0i64..1000) {
        let mut b = make_batch(len, width, seed);
        // Special values must survive too.
        let mut special = Tensor::ones([len as i64, 4], (Kind::Float, Device::Cpu));
        let _ = special.get(0).get(0).fill_(f64::NAN);
        let _ = special.get(0).get(1).fill_(-0.0);
        let _ = special.get(0).get(2).fill_(f64::INFINITY);
        special = special.contiguous();
        b.insert("special", special).unwrap();
        b.insert("doubles", Tensor::arange(len as i64, (Kind::Double, Device::Cpu)) / 3.0).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("batch.safetensors");
        b.save(&path).unwrap();
        assert_same(&Batch::load(&path, Device::Cpu).unwrap(), &b);
    }

    #[test]
    fn minibatches_cover_every_row_once_per_epoch(k in 1usize..5, size in 1usize..5, epochs in 1usize..4, seed in 0u64..1000, shuffle in any::<bool>()) {
        let b = make_batch(k * size, 2, 1);
        let minis: Vec<Batch> = b.iter_minibatches(size, shuffle, seed, epochs).unwrap().map(Result::unwrap).collect();
        prop_assert_eq!(minis.len(), k * epochs);
        for epoch in minis.chunks(k) {
            let mut seen: Vec<String> = epoch.iter().flat_map(uids).map(|v| v.as_str().unwrap().to_owned()).collect();
            seen.sort();
            let mut all: Vec<String> = uids(&b).into_iter().map(|v| v.as_str().unwrap().to_owned()).collect();
            all.sort();
            prop_assert_eq!(seen, all);
        }
        // Same seed, same order.
        let again: Vec<Vec<Value>> = b.iter_minibatches(size, shuffle, seed, epochs).unwrap().map(|m| uids(&m.unwrap())).collect();
        prop_assert_eq!(again, minis.iter().map(uids).collect::<Vec<_>>());
    }
}

#[test]
fn shuffled_epochs_draw_different_orders() {
    let b = make_batch(16, 1, 0);
    let minis: Vec<Vec<Value>> = b
        .iter_minibatches(16, true, 7, 3)
        .unwrap()
        .map(|m| uids(&m.unwrap()))
        .collect();
    assert_ne!(minis[0], minis[1]);
    assert_ne!(minis[1], minis[2]);
    let other_seed: Vec<Vec<Value>> = b
        .iter_minibatches(16, true, 8, 1)
        .unwrap()
        .map(|m| uids(&m.unwrap()))
        .collect();
    assert_ne!(minis[0], other_seed[0]);
}

#[test]
fn views_share_storage_and_copies_do_not() {
    let b = make_batch(8, 4, 0);
    let ptr = |x: &Batch| x.get(keys::OLD_LOG_PROBS).unwrap().data_ptr() as usize;
    let elt = 4 * 4; // f32 × width 4
    let base = ptr(&b);
    assert_eq!(ptr(&b.select(&[keys::OLD_LOG_PROBS]).unwrap()), base);
    assert_eq!(ptr(&b.slice(2..5).unwrap()), base + 2 * elt);
    let chunks = b.chunk(4).unwrap();
    assert_eq!(ptr(&chunks[3]), base + 6 * elt);
    assert_eq!(ptr(&b.split(3).unwrap()[1]), base + 3 * elt);
    assert_ne!(ptr(&b.repeat(2, true).unwrap()), base);
    assert_ne!(ptr(&b.reorder(&[0, 1, 2, 3, 4, 5, 6, 7]).unwrap()), base);
}

#[test]
fn get_pop_rename_select() {
    let mut b = make_batch(3, 2, 0);
    assert_eq!(b.len(), 3);
    let t = b.pop(keys::VALUES).unwrap();
    assert_eq!(t.size(), [3, 2]);
    assert!(!b.contains(keys::VALUES));
    b.rename(keys::OLD_LOG_PROBS, keys::REF_LOG_PROB).unwrap();
    assert!(b.get(keys::REF_LOG_PROB).is_ok());
    b.rename(keys::UID, "group").unwrap();
    assert_eq!(b.pop_column("group").unwrap().len(), 3);
    let s = b.select(&[keys::INPUT_IDS, keys::EXTRA_INFO]).unwrap();
    assert_eq!(s.tensor_keys().collect::<Vec<_>>(), [keys::INPUT_IDS]);
    assert_eq!(s.column_keys().collect::<Vec<_>>(), [keys::EXTRA_INFO]);
    assert_eq!(s.meta_info()["temperature"], json!(0.7));
}

#[test]
fn union_merges_and_accepts_equal_duplicates() {
    let mut a = make_batch(4, 2, 0);
    let b = make_batch(4, 2, 0); // same seed: identical values
    let mut extra = a.select(&[keys::INPUT_IDS]).unwrap();
    extra
        .insert(
            keys::ADVANTAGES,
            Tensor::ones([4, 2], (Kind::Float, Device::Cpu)),
        )
        .unwrap();
    a.union(extra).unwrap();
    assert!(a.contains(keys::ADVANTAGES));
    a.union(b).unwrap();
    assert_eq!(a.len(), 4);
}

#[test]
fn debug_lists_keys_shapes_and_dtypes() {
    let text = format!("{:?}", make_batch(2, 3, 0));
    assert!(text.contains("len: 2"), "{text}");
    assert!(
        text.contains("input_ids") && text.contains("[2, 4] Int64"),
        "{text}"
    );
    assert!(
        text.contains("values") && text.contains("BFloat16"),
        "{text}"
    );
    assert!(text.contains("uid") && text.contains("column[2]"), "{text}");
    assert!(text.contains("temperature"), "{text}");
}

#[test]
fn to_device_keeps_everything() {
    let b = make_batch(3, 2, 0);
    let moved = b.to(Device::Cpu).unwrap();
    assert_same(&moved, &b);
}

// ---- error paths -------------------------------------------------------------------------------

#[test]
fn insert_with_wrong_batch_dimension_names_key_and_sizes() {
    let mut b = make_batch(4, 2, 0);
    let err = b
        .insert(
            keys::ADVANTAGES,
            Tensor::zeros([3, 2], (Kind::Float, Device::Cpu)),
        )
        .unwrap_err();
    assert!(matches!(&err, Error::BatchSize { key, expected: 4, got: 3 } if key == "advantages"));
    assert_eq!(
        err.to_string(),
        "`advantages` has 3 rows but the batch has 4"
    );
    let err = b
        .insert_column(keys::DATA_SOURCE, vec![json!("gsm8k")])
        .unwrap_err();
    assert!(matches!(&err, Error::BatchSize { key, expected: 4, got: 1 } if key == "data_source"));
    let err = b.insert("scalar", Tensor::from(1.0f32)).unwrap_err();
    assert!(matches!(&err, Error::Shape { key, .. } if key == "scalar"));
}

#[test]
fn replacing_the_only_key_may_change_the_length() {
    let mut b = Batch::new();
    b.insert("x", Tensor::zeros([3], (Kind::Float, Device::Cpu)))
        .unwrap();
    b.insert("x", Tensor::zeros([5], (Kind::Float, Device::Cpu)))
        .unwrap();
    assert_eq!(b.len(), 5);
}

#[test]
fn a_key_cannot_be_both_tensor_and_column() {
    let mut b = make_batch(2, 2, 0);
    let err = b
        .insert(keys::UID, Tensor::zeros([2], (Kind::Float, Device::Cpu)))
        .unwrap_err();
    assert!(matches!(&err, Error::DuplicateKey { key, existing: "column" } if key == "uid"));
    let err = b
        .insert_column(keys::VALUES, vec![json!(1), json!(2)])
        .unwrap_err();
    assert!(matches!(&err, Error::DuplicateKey { key, existing: "tensor" } if key == "values"));
    let err = b.rename(keys::VALUES, keys::UID).unwrap_err();
    assert!(matches!(&err, Error::DuplicateKey { key, .. } if key == "uid"));
}

#[test]
fn missing_key_lists_what_is_present() {
    let mut b = make_batch(2, 2, 0);
    let err = b.get("advantage").unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("missing key `advantage` (present: "),
        "{msg}"
    );
    assert!(msg.contains("input_ids"), "{msg}");
    assert!(matches!(
        b.column("ground_truth"),
        Err(Error::MissingKey { .. })
    ));
    assert!(matches!(b.pop("nope"), Err(Error::MissingKey { .. })));
    assert!(matches!(
        b.pop_column("nope"),
        Err(Error::MissingKey { .. })
    ));
    assert!(matches!(
        b.rename("nope", "x"),
        Err(Error::MissingKey { .. })
    ));
    assert!(
        matches!(b.select(&[keys::INPUT_IDS, "nope"]), Err(Error::MissingKey { key, .. }) if key == "nope")
    );
    assert_eq!(
        Batch::new().get("x").unwrap_err().to_string(),
        "missing key `x` (present: none)"
    );
}

#[test]
fn union_conflicts_name_the_key_and_leave_self_untouched() {
    let mut a = make_batch(4, 2, 0);
    let before = a.tensor_keys().count();
    let mut other = make_batch(4, 2, 1); // different values under the same keys
    other
        .insert(
            keys::ADVANTAGES,
            Tensor::zeros([4, 2], (Kind::Float, Device::Cpu)),
        )
        .unwrap();
    let err = a.union(other).unwrap_err();
    assert!(matches!(&err, Error::Conflict { .. }), "{err}");
    assert_eq!(a.tensor_keys().count(), before, "nothing merged on error");

    let mut cols = Batch::new();
    cols.insert_column(keys::UID, (0..4).map(|i| json!(i)).collect())
        .unwrap();
    let err = make_batch(4, 2, 0).union(cols).unwrap_err();
    assert_eq!(
        err.to_string(),
        "union conflict on `uid`: both batches hold it with different values"
    );

    let mut meta = Batch::new();
    meta.meta_info_mut()
        .insert("temperature".into(), json!(1.0));
    let err = make_batch(4, 2, 0).union(meta).unwrap_err();
    assert!(matches!(&err, Error::Conflict { key } if key == "temperature"));

    let err = make_batch(4, 2, 0).union(make_batch(3, 2, 0)).unwrap_err();
    assert!(matches!(
        &err,
        Error::BatchSize {
            expected: 4,
            got: 3,
            ..
        }
    ));
}

#[test]
fn uneven_chunk_and_minibatch_are_errors() {
    let b = make_batch(5, 2, 0);
    let err = b.chunk(2).unwrap_err();
    assert_eq!(err.to_string(), "cannot chunk 5 rows into 2 equal chunks");
    assert!(matches!(
        b.chunk(0),
        Err(Error::UnevenChunk { len: 5, chunks: 0 })
    ));
    let err = b.iter_minibatches(2, true, 0, 1).err().unwrap();
    assert_eq!(
        err.to_string(),
        "mini-batch size 2 does not divide the batch of 5 rows"
    );
    assert!(matches!(
        b.split(0),
        Err(Error::InvalidArgument { name: "size", .. })
    ));
    assert!(matches!(
        b.repeat(0, true),
        Err(Error::InvalidArgument { name: "n", .. })
    ));
    assert!(matches!(
        b.pad_to_divisor(0),
        Err(Error::InvalidArgument {
            name: "divisor",
            ..
        })
    ));
    assert!(matches!(
        b.unpad(6),
        Err(Error::InvalidArgument { name: "pad", .. })
    ));
    assert!(matches!(
        b.slice(3..6),
        Err(Error::InvalidArgument { name: "range", .. })
    ));
    let (empty, pad) = Batch::new().pad_to_divisor(4).unwrap();
    assert_eq!((empty.len(), pad), (0, 0));
}

#[test]
fn reorder_out_of_range_names_the_index() {
    let b = make_batch(3, 2, 0);
    let err = b.reorder(&[0, 3]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "index 3 is out of range for a batch of 3 rows"
    );
    assert!(matches!(
        b.reorder(&[-1]),
        Err(Error::IndexOutOfRange { index: -1, len: 3 })
    ));
}

#[test]
fn concat_mismatches_name_part_key_and_sizes() {
    assert!(matches!(
        Batch::concat(&[]),
        Err(Error::InvalidArgument { name: "parts", .. })
    ));
    let a = make_batch(2, 2, 0);
    let mut b = make_batch(2, 2, 1);
    let _ = b.pop(keys::VALUES).unwrap();
    let err = Batch::concat(&[a.shallow_clone(), b]).unwrap_err();
    assert_eq!(err.to_string(), "concat part 1 lacks `values`");
    let mut c = make_batch(2, 2, 1);
    c.insert(
        keys::ADVANTAGES,
        Tensor::zeros([2, 2], (Kind::Float, Device::Cpu)),
    )
    .unwrap();
    let err = Batch::concat(&[a.shallow_clone(), c]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "concat part 1 has the extra key `advantages`"
    );
    let wide = make_batch(2, 3, 1);
    let err = Batch::concat(&[a.shallow_clone(), wide]).unwrap_err();
    assert!(
        matches!(&err, Error::Shape { key, got, .. } if key == "input_ids" && got == &vec![2, 4]),
        "{err}"
    );
    let mut dtype = make_batch(2, 2, 1);
    let v = dtype.pop(keys::VALUES).unwrap().to_kind(Kind::Float);
    dtype.insert(keys::VALUES, v).unwrap();
    let err = Batch::concat(&[a.shallow_clone(), dtype]).unwrap_err();
    assert!(
        matches!(&err, Error::Dtype { key, got: Kind::Float, .. } if key == "values"),
        "{err}"
    );
    let mut meta = make_batch(2, 2, 1);
    meta.meta_info_mut()
        .insert("temperature".into(), json!(1.0));
    assert!(
        matches!(Batch::concat(&[a, meta]), Err(Error::Conflict { key }) if key == "temperature")
    );
}

#[test]
fn load_rejects_bad_files_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.safetensors");
    let err = Batch::load(&missing, Device::Cpu).unwrap_err();
    assert!(matches!(&err, Error::Io { path, .. } if path.ends_with("absent.safetensors")));

    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"definitely not safetensors").unwrap();
    let err = Batch::load(&garbage, Device::Cpu).unwrap_err();
    assert!(
        err.to_string()
            .contains("garbage.safetensors: not a safetensors file"),
        "{err}"
    );

    // A valid safetensors file that Batch::save did not write.
    let foreign = dir.path().join("foreign.safetensors");
    tch::Tensor::write_safetensors(
        &[("w", Tensor::zeros([2], (Kind::Float, Device::Cpu)))],
        &foreign,
    )
    .unwrap();
    let err = Batch::load(&foreign, Device::Cpu).unwrap_err();
    assert!(
        err.to_string().contains("not written by Batch::save"),
        "{err}"
    );

    // Truncated file.
    let good = dir.path().join("good.safetensors");
    make_batch(2, 2, 0).save(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 5]).unwrap();
    let err = Batch::load(&cut, Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, Error::Format { path, .. } if path.ends_with("cut.safetensors")),
        "{err}"
    );
}

#[test]
fn save_rejects_unsupported_dtypes() {
    let mut b = Batch::new();
    b.insert("c", Tensor::zeros([2], (Kind::ComplexFloat, Device::Cpu)))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let err = b.save(dir.path().join("c.safetensors")).unwrap_err();
    assert!(matches!(&err, Error::Dtype { key, got: Kind::ComplexFloat, .. } if key == "c"));
}
