//! Criterion benchmark of `Batch` operations on a 1024×4096 batch (four tensors, ~96 MB):
//! `concat`, `repeat` and `reorder` copy tensor data, while `chunk`, `split`, `slice` and
//! `select` are views whose cost does not depend on the tensor sizes.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use rl_core::{Batch, keys};
use tch::{Device, Kind, Tensor};

const ROWS: i64 = 1024;
const COLS: i64 = 4096;

fn batch() -> Batch {
    let mut b = Batch::new();
    let ints = (Kind::Int64, Device::Cpu);
    let floats = (Kind::Float, Device::Cpu);
    b.insert(
        keys::INPUT_IDS,
        Tensor::arange(ROWS * COLS, ints).view([ROWS, COLS]),
    )
    .unwrap();
    b.insert(keys::ATTENTION_MASK, Tensor::ones([ROWS, COLS], ints))
        .unwrap();
    b.insert(keys::RESPONSE_MASK, Tensor::ones([ROWS, COLS], floats))
        .unwrap();
    b.insert(keys::OLD_LOG_PROBS, Tensor::zeros([ROWS, COLS], floats))
        .unwrap();
    b.insert_column(
        keys::UID,
        (0..ROWS).map(|i| format!("uid-{}", i / 8).into()).collect(),
    )
    .unwrap();
    b
}

fn bench(c: &mut Criterion) {
    tch::set_num_threads(2);
    let b = batch();
    let halves = b.chunk(2).unwrap();
    let mut g = c.benchmark_group("batch_1024x4096");
    g.sample_size(20);
    g.bench_function("concat_2_halves (copies)", |bench| {
        bench.iter(|| black_box(Batch::concat(&halves).unwrap()))
    });
    g.bench_function("repeat_4_interleave (copies)", |bench| {
        bench.iter(|| black_box(b.repeat(4, true).unwrap()))
    });
    let perm: Vec<i64> = (0..ROWS).rev().collect();
    g.bench_function("reorder (copies)", |bench| {
        bench.iter(|| black_box(b.reorder(&perm).unwrap()))
    });
    g.bench_function("chunk_8 (view)", |bench| {
        bench.iter(|| black_box(b.chunk(8).unwrap()))
    });
    g.bench_function("split_128 (view)", |bench| {
        bench.iter(|| black_box(b.split(128).unwrap()))
    });
    g.bench_function("slice (view)", |bench| {
        bench.iter(|| black_box(b.slice(100..900).unwrap()))
    });
    g.bench_function("select_2_keys (view)", |bench| {
        bench.iter(|| black_box(b.select(&[keys::INPUT_IDS, keys::UID]).unwrap()))
    });
    g.finish();

    // The views really share storage: no tensor data was copied.
    let base = b.get(keys::INPUT_IDS).unwrap().data_ptr();
    assert_eq!(
        b.chunk(8).unwrap()[0]
            .get(keys::INPUT_IDS)
            .unwrap()
            .data_ptr(),
        base
    );
    assert_eq!(
        b.select(&[keys::INPUT_IDS])
            .unwrap()
            .get(keys::INPUT_IDS)
            .unwrap()
            .data_ptr(),
        base
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
