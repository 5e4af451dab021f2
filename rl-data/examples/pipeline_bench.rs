//! The Rust half of the prompt-pipeline benchmark (`rl-data/benches/pipeline.sh` runs both
//! halves and prints the ratio): load verl-schema parquet, render with the chat template,
//! tokenise, left-pad into tensors.
//!
//! ```text
//! pipeline_bench gen <out.parquet> <rows>          # GSM8K-sized word problems, seed 0
//! pipeline_bench run <in.parquet> <tokenizer_dir>  # prints one JSON line of figures
//! pipeline_bench gen-big <out.parquet> <megabytes> # a large verl-schema file, written in chunks
//! pipeline_bench mem <in.parquet> dataset|stream   # peak RSS of opening/reading it
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rl_data::tasks::{SplitSizes, WordProblemsConfig, generate_word_problems};
use rl_data::{DataConfig, DataLoader, LoaderOptions, RlDataset, Tokenizer, Truncation};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("gen") if args.len() == 4 => {
            let out = PathBuf::from(&args[2]);
            let rows: usize = args[3].parse()?;
            let dir = tempdir_beside(&out)?;
            let files = generate_word_problems(
                &dir,
                &WordProblemsConfig {
                    max_value: 1000,
                    ..Default::default()
                },
                SplitSizes {
                    train: rows,
                    test: 0,
                },
                0,
            )?;
            std::fs::rename(&files.train, &out)?;
            std::fs::remove_dir_all(&dir)?;
            println!("wrote {rows} rows to {}", out.display());
        }
        Some("run") if args.len() == 4 => run(Path::new(&args[2]), Path::new(&args[3]))?,
        Some("gen-big") if args.len() == 4 => gen_big(Path::new(&args[2]), args[3].parse()?)?,
        Some("mem") if args.len() == 4 => mem(Path::new(&args[2]), &args[3])?,
        _ => {
            eprintln!(
                "usage: pipeline_bench gen <out.parquet> <rows> | run <in.parquet> <tokenizer_dir> \
                 | gen-big <out.parquet> <megabytes> | mem <in.parquet> dataset|stream"
            );
            std::process::exit(2);
        }
    }
    Ok(())
}

fn tempdir_beside(out: &Path) -> std::io::Result<PathBuf> {
    let dir = out.with_extension("gen.tmp");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn run(parquet: &Path, tokenizer_dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let start = Instant::now();
    let tokenizer = Arc::new(Tokenizer::from_dir(tokenizer_dir)?);
    let cfg = DataConfig {
        train_files: vec![parquet.to_path_buf()],
        train_batch_size: 1024,
        shuffle: false,
        drop_last: false,
        max_prompt_length: 4096,
        truncation: Truncation::Error,
        pad_to_max_prompt_length: false,
        ..DataConfig::default()
    };
    let dataset = Arc::new(RlDataset::train(&cfg)?);
    let mut loader = DataLoader::new(dataset, tokenizer, LoaderOptions::train(&cfg))?;
    let (mut rows, mut tokens, mut checksum) = (0usize, 0i64, 0i64);
    while let Some(batch) = loader.next_batch()? {
        rows += batch.len();
        tokens += batch.attention_mask.sum(tch::Kind::Int64).int64_value(&[]);
        checksum += (&batch.input_ids * &batch.attention_mask)
            .sum(tch::Kind::Int64)
            .int64_value(&[]);
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"impl\": \"rust\", \"rows\": {rows}, \"secs\": {secs:.3}, \"rows_per_s\": {:.1}, \"tokens\": {tokens}, \"checksum\": {checksum}}}",
        rows as f64 / secs
    );
    Ok(())
}

/// Peak resident memory of this process in MiB (Linux `VmHWM`).
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Writes about `megabytes` MB of verl-schema rows with poorly compressible prompts (random
/// words and numbers), 50k rows per row group, never holding more than one group in memory.
fn gen_big(out: &Path, megabytes: u64) -> Result<(), Box<dyn std::error::Error>> {
    use rand_chacha::ChaCha8Rng;
    use rand_chacha::rand_core::{Rng, SeedableRng};
    use rl_data::{Message, RlRecord};
    let mut rng = ChaCha8Rng::from_seed([7; 32]);
    let words: Vec<String> = (0..5000)
        .map(|i| format!("w{:x}{}", i * 7919, (b'a' + (i % 26) as u8) as char))
        .collect();
    let target = megabytes * 1_000_000;
    let mut part = 0;
    let dir = out.with_extension("parts");
    std::fs::create_dir_all(&dir)?;
    let mut written = 0u64;
    let mut row = 0u64;
    while written < target {
        let records: Vec<RlRecord> = (0..50_000)
            .map(|_| {
                row += 1;
                let text: Vec<String> = (0..120)
                    .map(|_| {
                        let r = rng.next_u64();
                        if r % 5 == 0 {
                            (r >> 8).to_string()
                        } else {
                            words[(r >> 16) as usize % words.len()].clone()
                        }
                    })
                    .collect();
                let mut extra = serde_json::Map::new();
                extra.insert("index".into(), row.into());
                RlRecord {
                    data_source: "openai/gsm8k".into(),
                    prompt: vec![Message::user(text.join(" "))],
                    ability: "math".into(),
                    style: "rule".into(),
                    ground_truth: serde_json::Value::String((rng.next_u64() % 1000).to_string()),
                    extra_info: extra,
                }
            })
            .collect();
        let p = dir.join(format!("part{part:04}.parquet"));
        rl_data::write_rl_parquet(&p, &records)?;
        written += std::fs::metadata(&p)?.len();
        part += 1;
    }
    // Concatenate the parts into one file, batch by batch.
    let mut parts: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    parts.sort();
    let first = std::fs::File::open(&parts[0])?;
    let schema = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(first)?
        .schema()
        .clone();
    let mut w = parquet::arrow::ArrowWriter::try_new(
        std::fs::File::create(out)?,
        schema,
        Some(
            parquet::file::properties::WriterProperties::builder()
                .set_compression(parquet::basic::Compression::SNAPPY)
                .build(),
        ),
    )?;
    for p in &parts {
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
            std::fs::File::open(p)?,
        )?
        .build()?;
        for b in reader {
            w.write(&b?)?;
        }
        w.flush()?;
    }
    w.close()?;
    std::fs::remove_dir_all(&dir)?;
    println!(
        "{{\"file_mb\": {:.1}, \"rows\": {row}, \"peak_rss_mib\": {:.1}}}",
        std::fs::metadata(out)?.len() as f64 / 1e6,
        peak_rss_mib()
    );
    Ok(())
}

/// Opens `parquet` as an [`RlDataset`] (then touches every row) or streams it with
/// [`rl_data::stream_rows`], and reports the peak RSS.
fn mem(parquet: &Path, mode: &str) -> Result<(), Box<dyn std::error::Error>> {
    let start = Instant::now();
    let opts = rl_data::ReadOptions {
        prompt_key: "prompt".into(),
        reward_fn_key: "data_source".into(),
        max_samples: None,
    };
    let mut chars = 0usize;
    let rows = match mode {
        "dataset" => {
            let ds = RlDataset::open(&[parquet.to_path_buf()], &opts)?;
            for i in 0..ds.len() {
                chars += ds.row(i)?.prompt[0].content.len();
            }
            ds.len()
        }
        "stream" => {
            let mut n = 0;
            for row in rl_data::stream_rows(&[parquet.to_path_buf()], &opts) {
                chars += row?.prompt[0].content.len();
                n += 1;
            }
            n
        }
        other => return Err(format!("mode must be dataset or stream, got {other}").into()),
    };
    println!(
        "{{\"mode\": \"{mode}\", \"file_mb\": {:.1}, \"rows\": {rows}, \"prompt_mb\": {:.1}, \"secs\": {:.1}, \"peak_rss_mib\": {:.1}}}",
        std::fs::metadata(parquet)?.len() as f64 / 1e6,
        chars as f64 / 1e6,
        start.elapsed().as_secs_f64(),
        peak_rss_mib()
    );
    Ok(())
}
