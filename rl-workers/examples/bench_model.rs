//! The Rust side of `benches/side_by_side.py`: batched generation (greedy and sampled) and
//! forward+backward throughput on one model and one set of prompt token ids, printed as JSON.
//!
//! Usage: `bench_model MODEL_DIR PROMPTS.json NEW_TOKENS THREADS`, where PROMPTS.json is a list
//! of token-id lists (left-padded here with the model's pad id). `BENCH_ONLY=greedy` (or
//! `sampled`) runs that generation alone and prints its figures: for profiling one phase.
//! `BENCH_N=8` is the GRPO shape: greedy over every prompt repeated 8 times, sampled with
//! `n = 8` (one prefill per prompt shared by its samples); `BENCH_FWD_BWD=0` skips the
//! forward+backward; `BENCH_FUSED=1` runs the forward+backward through the fused head
//! (`rl_workers::fused_head`, verl's `use_fused_kernels`). The machine's matmul rate is probed
//! right before and after each generation (`greedy_probe_before`/`_after`,
//! `sampled_probe_before`/`_after`, see [`matmul_rate`]) for the script's floors;
//! `BENCH_PROBE=0` skips that (for profiling).

use std::time::Instant;

use rl_workers::fused_head::fused_log_probs;
use rl_workers::{CausalLm, GenerateOptions, RolloutConfig, generate};
use tch::{Device, Kind, Tensor};

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The machine's f32 matmul rate (GFLOP/s) on the floor's product in `side_by_side.py`: `rows` x
/// 576 inputs by a 1536 x 576 weight through oneDNN (`mkldnn_linear` on oneDNN tensors, the
/// faster of libtorch's two libraries on this CPU), the best of 5 timings of about 0.2 s. Taken
/// right before and right after the greedy generation, so that the floor it is compared with is
/// the machine's rate at the time it ran: two virtual cores here run a 32-row product at either
/// about 250 or about 335 GFLOP/s for tens of seconds at a time (one thread: 183 throughout).
/// Inputs are ones, so no random numbers are drawn.
fn matmul_rate(rows: i64) -> f64 {
    let x = Tensor::ones([rows, 576], (Kind::Float, Device::Cpu)).g_to_mkldnn(None);
    let w = Tensor::ones([1536, 576], (Kind::Float, Device::Cpu)).g_to_mkldnn(None);
    let flops = 2.0 * (rows * 576 * 1536) as f64;
    let reps = ((0.2 * 300e9 / flops) as usize).max(3);
    let run = || drop(x.mkldnn_linear(&w, None::<Tensor>));
    (0..3).for_each(|_| run());
    (0..5)
        .map(|_| {
            let start = Instant::now();
            (0..reps).for_each(|_| run());
            flops * reps as f64 / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// [`matmul_rate`] at the decode's row count and at prefill's 2048 rows, as JSON.
fn probe(rows: i64) -> serde_json::Value {
    serde_json::json!({
        format!("matmul_gflops_m{rows}"): matmul_rate(rows),
        "matmul_gflops_m2048": matmul_rate(2048),
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, prompts, new_tokens, threads] = args.as_slice() else {
        return Err("usage: bench_model MODEL_DIR PROMPTS.json NEW_TOKENS THREADS".into());
    };
    let new_tokens: i64 = new_tokens.parse()?;
    // as `harness` runs (rl_workers::heap; glibc's MALLOC_* variables opt out)
    let keeps_freed_memory = rl_workers::heap::keep_freed_memory();
    tch::set_num_threads(threads.parse()?);
    let rows: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(prompts)?)?;
    let lm = CausalLm::from_pretrained(dir, Device::Cpu, Kind::Float)?;
    let pad = lm.config().pad_token_id.unwrap_or(0);
    let width = rows.iter().map(Vec::len).max().unwrap_or(1);
    let mut ids = vec![pad; rows.len() * width];
    let mut mask = vec![0i64; rows.len() * width];
    for (r, row) in rows.iter().enumerate() {
        let start = r * width + width - row.len();
        ids[start..start + row.len()].copy_from_slice(row);
        mask[start..start + row.len()]
            .iter_mut()
            .for_each(|m| *m = 1);
    }
    let shape = [rows.len() as i64, width as i64];
    let input_ids = Tensor::from_slice(&ids).view(shape);
    let mask = Tensor::from_slice(&mask).view(shape);
    let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);

    let n: i64 = match std::env::var("BENCH_N") {
        Err(_) => 1,
        Ok(v) => v
            .parse()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("BENCH_N: '{v}' is not a count of samples >= 1"))?,
    };
    let flag = |key: &str, default: bool| -> Result<bool, String> {
        match std::env::var(key).as_deref() {
            Err(_) => Ok(default),
            Ok("0") => Ok(false),
            Ok("1") => Ok(true),
            Ok(v) => Err(format!("{key}: '{v}' is not 0 or 1")),
        }
    };
    let fwd_bwd = flag("BENCH_FWD_BWD", true)?;
    rl_workers::gemm::set_cpu_gemm(if flag("BENCH_ONEDNN", true)? {
        rl_workers::gemm::CpuGemm::OneDnn
    } else {
        rl_workers::gemm::CpuGemm::Blas
    });
    let fused = flag("BENCH_FUSED", false)?;
    let warm = flag("BENCH_WARM", false)?;
    let mut report = serde_json::Map::new();
    report.insert("keeps_freed_memory".to_owned(), keeps_freed_memory.into());
    let mut greedy_out = None;
    let only = std::env::var("BENCH_ONLY").ok();
    if let Some(o) = only
        .as_deref()
        .filter(|o| !matches!(*o, "greedy" | "sampled"))
    {
        return Err(format!("BENCH_ONLY: '{o}' is not greedy or sampled").into());
    }
    for (name, do_sample) in [("greedy", false), ("sampled", true)] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        // greedy samples would all be the same: n copies of each prompt instead
        let (input_ids, mask, pos, n) = if do_sample {
            (
                input_ids.shallow_clone(),
                mask.shallow_clone(),
                pos.shallow_clone(),
                n,
            )
        } else {
            let rep = |t: &Tensor| t.repeat_interleave_self_int(n, 0, None);
            (rep(&input_ids), rep(&mask), rep(&pos), 1)
        };
        let cfg = RolloutConfig {
            n: n as usize,
            do_sample,
            top_k: -1,
            top_p: 1.0,
            temperature: 1.0,
            response_length: new_tokens,
            ..Default::default()
        };
        let mut opts = GenerateOptions::from_config(lm.config());
        opts.seed = 1234;
        // the rows each decode step computes: every prompt's n samples
        let probe_rows = input_ids.size()[0] * n;
        let probing = flag("BENCH_PROBE", true)?;
        if probing {
            report.insert(format!("{name}_probe_before"), probe(probe_rows));
        }
        if warm {
            // a rollout in a training loop is never the process's first: the same generation
            // once untimed (oneDNN's kernels made, the allocator's heap grown), as the
            // forward+backward's first of four is
            let start = Instant::now();
            let mut first = GenerateOptions::from_config(lm.config());
            first.seed = opts.seed;
            generate(&lm, &input_ids, &mask, &pos, &cfg, &mut first)?;
            report.insert(
                format!("{name}_first_seconds"),
                start.elapsed().as_secs_f64().into(),
            );
        }
        let start = Instant::now();
        let out = generate(&lm, &input_ids, &mask, &pos, &cfg, &mut opts)?;
        let secs = start.elapsed().as_secs_f64();
        if probing {
            report.insert(format!("{name}_probe_after"), probe(probe_rows));
        }
        let tokens = out.response_mask.sum(Kind::Float).double_value(&[]);
        report.insert(format!("{name}_seconds"), secs.into());
        report.insert(format!("{name}_tokens"), tokens.into());
        report.insert(format!("{name}_tokens_per_s"), (tokens / secs).into());
        if name == "greedy" {
            let responses: Vec<Vec<i64>> = Vec::try_from(&out.responses)?;
            report.insert(
                "greedy_responses".to_owned(),
                serde_json::to_value(responses)?,
            );
            greedy_out = Some(out);
        }
    }

    if only.is_some() || !fwd_bwd {
        report.insert("peak_rss_mib".to_owned(), peak_rss_mib().into());
        println!("{}", serde_json::Value::Object(report));
        return Ok(());
    }
    // forward + backward of the mean token log-likelihood on the greedy batch
    let out = greedy_out.expect("greedy ran");
    let (ids, mask, pos) = (&out.input_ids, &out.attention_mask, &out.position_ids);
    let len = ids.size()[1];
    let targets = ids.narrow(1, 1, len - 1);
    let weight = mask.narrow(1, 1, len - 1).to_kind(Kind::Float);
    let mut times = Vec::new();
    for _ in 0..4 {
        lm.var_store()
            .trainable_variables()
            .iter_mut()
            .for_each(|t| t.zero_grad());
        let start = Instant::now();
        if fused {
            let hidden = lm.model().forward(ids, mask, pos, None)?;
            let head = fused_log_probs(&lm, &hidden.narrow(1, 0, len - 1), &targets, 1.0, false);
            let loss = -(&head.log_prob * &weight).sum(Kind::Float) / weight.sum(Kind::Float);
            loss.backward();
            head.pending.finish(&lm);
        } else {
            let logits = lm.forward(ids, mask, pos, None)?;
            let logp = logits
                .narrow(1, 0, len - 1)
                .log_softmax(-1, Kind::Float)
                .gather(2, &targets.unsqueeze(-1), false);
            let loss = -(logp.squeeze_dim(-1) * &weight).sum(Kind::Float) / weight.sum(Kind::Float);
            loss.backward();
        }
        times.push(start.elapsed().as_secs_f64());
    }
    let secs = times[1..].iter().sum::<f64>() / (times.len() - 1) as f64;
    let tokens = mask.sum(Kind::Float).double_value(&[]);
    report.insert("fwd_bwd_seconds".to_owned(), secs.into());
    report.insert("fwd_bwd_tokens_per_s".to_owned(), (tokens / secs).into());
    report.insert("fwd_bwd_fused".to_owned(), fused.into());
    report.insert(
        "fwd_bwd_shape".to_owned(),
        serde_json::to_value(ids.size())?,
    );
    report.insert("peak_rss_mib".to_owned(), peak_rss_mib().into());
    println!("{}", serde_json::Value::Object(report));
    Ok(())
}
