//! Criterion benches for the per-step data costs: render + tokenise + collate a batch of
//! prompts, and rule-reward scoring. The full-pipeline comparison with Python is
//! `benches/pipeline.sh`.

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, criterion_group, criterion_main};
use rl_data::reward::RewardRegistry;
use rl_data::{Message, Tokenizer, collate_left_padded};

fn fixture_tokenizer() -> Tokenizer {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    Tokenizer::from_files(
        root.join("tokenizers/smollm2.json"),
        Some(&root.join("cases/smollm2/tokenizer_config.json")),
    )
    .expect("fixture tokenizer")
}

fn prompts(n: usize) -> Vec<Vec<Message>> {
    (0..n)
        .map(|i| {
            vec![Message::user(format!(
                "Natalia sold clips to {i} of her friends in April, and then she sold half as many \
                 clips in May. How many clips did Natalia sell altogether in April and May? \
                 Let's think step by step and output the final answer after \"####\"."
            ))]
        })
        .collect()
}

fn bench_prompts(c: &mut Criterion) {
    let tok = fixture_tokenizer();
    let msgs = prompts(256);
    c.bench_function("render+tokenise+collate 256 prompts", |b| {
        b.iter(|| {
            let texts: Vec<String> = msgs
                .iter()
                .map(|m| tok.apply_chat_template(m, true).expect("render"))
                .collect();
            let ids = tok.encode_batch(&texts, false).expect("encode");
            black_box(collate_left_padded(&ids, 0, None).expect("collate"))
        })
    });
}

fn bench_rewards(c: &mut Criterion) {
    let r = RewardRegistry::verl_default();
    let gt = serde_json::Value::from("72");
    let none = serde_json::Value::Null;
    let gsm = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72";
    let math = "So we get $x = \\dfrac{144}{2}$ and the answer is \\boxed{72}.";
    c.bench_function("gsm8k score x1000", |b| {
        b.iter(|| {
            (0..1000)
                .map(|_| {
                    r.score("openai/gsm8k", gsm, &gt, &none)
                        .expect("score")
                        .score
                })
                .sum::<f64>()
        })
    });
    c.bench_function("math score x1000", |b| {
        b.iter(|| {
            (0..1000)
                .map(|_| {
                    r.score("lighteval/MATH", math, &gt, &none)
                        .expect("score")
                        .score
                })
                .sum::<f64>()
        })
    });
}

/// The SmolLM2 tokenizer `scripts/import-smollm2` writes, or the fixture one without it.
fn smollm2_tokenizer() -> Tokenizer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/smollm2-135m-instruct");
    if dir.join("tokenizer.json").exists() {
        Tokenizer::from_dir(&dir).expect("models/smollm2-135m-instruct")
    } else {
        fixture_tokenizer()
    }
}

/// Tokenising alone, 1024 rendered prompts: `Tokenizer::encode_batch` (pieces between added
/// tokens, the ASCII byte-level shortcut) on one thread and on all, against the `tokenizers`
/// crate's own `encode_fast` row by row.
fn bench_encode(c: &mut Criterion) {
    let tok = smollm2_tokenizer();
    let texts: Vec<String> = prompts(1024)
        .iter()
        .map(|m| tok.apply_chat_template(m, true).expect("render"))
        .collect();
    c.bench_function("encode_batch 1024 prompts", |b| {
        b.iter(|| black_box(tok.encode_batch(&texts, false).expect("encode")))
    });
    c.bench_function("encode 1024 prompts one by one", |b| {
        b.iter(|| {
            texts
                .iter()
                .map(|t| tok.encode(t, false).expect("encode").len())
                .sum::<usize>()
        })
    });
    c.bench_function("tokenizers encode_fast 1024 prompts one by one", |b| {
        b.iter(|| {
            texts
                .iter()
                .map(|t| {
                    tok.inner()
                        .encode_fast(t.as_str(), false)
                        .expect("encode")
                        .len()
                })
                .sum::<usize>()
        })
    });
}

criterion_group!(benches, bench_prompts, bench_encode, bench_rewards);
criterion_main!(benches);
