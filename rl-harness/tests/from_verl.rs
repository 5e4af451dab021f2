//! `harness config from-verl` (issue 19) on the command lines of verl's own example scripts
//! (`tests/fixtures/verl/`, written by hand from verl's docs): what it maps, what it notes as
//! having no effect here, what it refuses, and that the TOML it writes trains here.

mod common;

use std::path::PathBuf;

use common::{Env, tiny_llm};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/verl")
        .join(name)
}

/// `config from-verl FIXTURE --out OUT`: (success, stderr).
fn convert(env: &Env, name: &str, out: &str) -> (bool, String) {
    let o = env.run(&[
        "config",
        "from-verl",
        fixture(name).to_str().unwrap(),
        "--out",
        out,
    ]);
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn verls_example_command_lines_convert_and_train() {
    let env = Env::new();
    tiny_llm(&env, 32, 8);
    for (name, out) in [
        ("grpo_gsm8k.sh", "grpo.toml"),
        ("ppo_gsm8k.sh", "ppo.toml"),
        ("dapo.sh", "dapo.toml"),
    ] {
        let (ok, err) = convert(&env, name, out);
        assert!(ok, "{name}: {err}");
        assert!(err.contains(", 0 refused;"), "{name}: {err}");
        for line in [
            "mapped      trainer.algorithm = \"on_policy\" (the entry point)",
            "no effect   trainer.nnodes: a multi-node run starts its ranks under torchrun",
            "no effect   actor_rollout_ref.actor.fsdp_config.param_offload: FSDP is set here by `zero_stage` alone",
        ] {
            assert!(err.contains(line), "{name} lacks {line:?}: {err}");
        }
    }
    let grpo = std::fs::read_to_string(env.path().join("grpo.toml")).unwrap();
    for line in [
        "adv_estimator = \"grpo\"",
        "use_kl_loss = true",
        "kl_loss_type = \"low_var_kl\"",
        "filter_overlong_prompts = true",
        "tensorboard = true",
    ] {
        assert!(grpo.contains(line), "grpo.toml lacks {line:?}:\n{grpo}");
    }
    let dapo = std::fs::read_to_string(env.path().join("dapo.toml")).unwrap();
    for line in [
        "clip_ratio_high = 0.28",
        "loss_agg_mode = \"token-mean\"",
        "[algorithm.filter_groups]",
        "[reward_model.overlong_buffer]",
    ] {
        assert!(dapo.contains(line), "dapo.toml lacks {line:?}:\n{dapo}");
    }
    // verl fills the critic's mini-batch from the actor's; so does the conversion
    let (_, err) = convert(&env, "ppo_gsm8k.sh", "ppo.toml");
    assert!(
        err.contains(
            "critic.ppo_mini_batch_size = 8 (from actor_rollout_ref.actor.ppo_mini_batch_size"
        ),
        "{err}"
    );
    // the GRPO and PPO conversions train here, a step each, on the tiny task
    for toml in ["grpo.toml", "ppo.toml"] {
        env.ok(&[
            "train",
            toml,
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
        ]);
    }
    env.ok(&["config", "show", "dapo.toml"]);
}

#[test]
fn a_key_from_verl_that_does_not_exist_here_is_refused_and_the_exit_status_says_so() {
    let env = Env::new();
    let script = env.file(
        "run.sh",
        "python3 -m verl.trainer.main_ppo \\\n    data.train_batch_size=8 \\\n    \
         actor_rollout_ref.actor.optim.lrr=1e-6 \\\n    data.val_files=$NO_SUCH_DIR/test.parquet \\\n    \
         actor_rollout_ref.actor.use_kl_loss=maybe\n",
    );
    let out = env
        .cmd()
        .args([
            "config",
            "from-verl",
            script.to_str().unwrap(),
            "--out",
            "x.toml",
        ])
        .env_remove("NO_SUCH_DIR")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("refused     actor_rollout_ref.actor.optim.lrr")
            && err.contains(
                "refused     data.val_files: `data.val_files=$NO_SUCH_DIR/test.parquet`: \
                 `$NO_SUCH_DIR` is set neither by the script nor in the environment; set it in \
                 the TOML by hand"
            )
            && err.contains("refused     actor_rollout_ref.actor.use_kl_loss")
            && err.contains("3 verl key(s) refused"),
        "{err}"
    );
    // what could be mapped was written
    let toml = std::fs::read_to_string(env.path().join("x.toml")).unwrap();
    assert!(toml.contains("train_batch_size = 8"), "{toml}");
    // verl's resolved YAML config (a few of its keys): nested tables, unset keys left out
    let yaml = env.file(
        "config.yaml",
        "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-06\n  rollout:\n    name: vllm\n    mode: async\n\
         trainer:\n  nnodes: 1\n  total_epochs: 2\n  resume_from_path: null\n  logger:\n  - console\n",
    );
    let out = env.run(&["config", "from-verl", yaml.to_str().unwrap()]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("lr = 0.000001") && stdout.contains("total_epochs = 2"),
        "{stdout}"
    );
    assert!(
        stderr.contains("no effect   actor_rollout_ref.rollout.mode")
            && stderr.contains("no effect   trainer.nnodes")
            && !stderr.contains("resume_from_path"),
        "{stderr}"
    );
    // the command line itself, as one argument
    let out = env.run(&[
        "config",
        "from-verl",
        "python3 -m verl.trainer.main_ppo data.train_files=[a.parquet,b.parquet] trainer.nnodes=2",
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("train_files = [\"a.parquet\", \"b.parquet\"]"),
        "two files, not one named [a,b]: {stdout}"
    );
    assert!(stderr.contains("no effect   trainer.nnodes"), "{stderr}");
    // something that is not a verl command line at all
    let other = env.file("other.sh", "echo hello\n");
    let err = env.fails(&["config", "from-verl", other.to_str().unwrap()]);
    assert!(err.contains("no verl entry point in it"), "{err}");
}

/// A script as verl's examples write them (`tests/fixtures/verl/grpo_variables.sh`): its
/// variables, `$HOME`, defaults, arithmetic, an `if`, the keys in bash arrays and `"$@"` are
/// read as bash passes them to verl, the script's own arguments included, and the TOML trains.
#[test]
fn a_script_s_variables_and_arrays_are_read_as_bash_passes_them() {
    let env = Env::new();
    tiny_llm(&env, 32, 8);
    let home = env.path().to_str().unwrap();
    let convert = |args: &[&str], vars: &[(&str, &str)]| {
        let mut c = env.cmd();
        c.args([
            "config",
            "from-verl",
            fixture("grpo_variables.sh").to_str().unwrap(),
        ])
        .args(["--out", "vars.toml"])
        .args(args)
        .env("HOME", home)
        .env_remove("MODEL_PATH")
        .env_remove("NGPUS");
        for (k, v) in vars {
            c.env(k, v);
        }
        let o = c.output().unwrap();
        let toml = std::fs::read_to_string(env.path().join("vars.toml")).unwrap_or_default();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
            toml,
        )
    };
    // `"$@"`: the script's arguments after it, as verl's scripts take overrides
    let (ok, err, toml) = convert(
        &["trainer.total_epochs=2", "trainer.project_name=mine"],
        &[],
    );
    assert!(ok && err.contains(", 0 refused;"), "{err}");
    for line in [
        format!("train_files = [\"{home}/data/tiny-addition/train.parquet\"]"),
        format!("path = \"{home}/models/tiny-llama\""),
        "max_prompt_length = 64".to_owned(),
        "n = 2".to_owned(),
        "adv_estimator = \"grpo\"".to_owned(),
        "total_epochs = 2".to_owned(),
        "project_name = \"mine\"".to_owned(),
        "ppo_mini_batch_size = 8".to_owned(),
    ] {
        assert!(toml.contains(&line), "vars.toml lacks {line:?}:\n{toml}");
    }
    // a mapped value from a variable says which word it came from
    assert!(
        err.contains("mapped      algorithm.adv_estimator = \"grpo\" (from `algorithm.adv_estimator=$adv_estimator`)"),
        "{err}"
    );
    // `${MODEL_PATH:-...}` takes the environment's value where it is set
    let (_, _, toml) = convert(&[], &[("MODEL_PATH", "/elsewhere/model")]);
    assert!(toml.contains("path = \"/elsewhere/model\""), "{toml}");
    env.ok(&[
        "train",
        "vars.toml",
        &format!("actor_rollout_ref.model.path={home}/models/tiny-llama"),
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
    ]);
    // keys lost as bash would lose them are said, not dropped: a `\` before a comment ends
    // the command, and a key whose variable is unknown is refused with the reason
    let script = env.file(
        "cut.sh",
        "NOW=$(date +%Y%m%d)\npython3 -m verl.trainer.main_ppo \\\n  algorithm.adv_estimator=gae \\  # or grpo\n  \
         data.train_batch_size=8 \\\n  trainer.experiment_name=run_$NOW\n",
    );
    let err = env.fails(&["config", "from-verl", script.to_str().unwrap()]);
    for line in [
        "refused     (the verl command): it ends a line before line 4, where `data.train_batch_size=8` starts a command of its own",
        "1 verl key(s) refused",
    ] {
        assert!(err.contains(line), "lacks {line:?}: {err}");
    }
    let script = env.file(
        "date.sh",
        "NOW=$(date +%Y%m%d)\npython3 -m verl.trainer.main_ppo trainer.experiment_name=run_$NOW\n",
    );
    let err = env.fails(&["config", "from-verl", script.to_str().unwrap()]);
    assert!(
        err.contains(
            "refused     trainer.experiment_name: `trainer.experiment_name=run_$NOW`: `$NOW`, set on \
             line 1: `$(date +%Y%m%d)` is a command's output, which is not run here"
        ),
        "{err}"
    );
}

/// A run's config as Hydra saves it (`.hydra/config.yaml`: OmegaConf's interpolations as
/// written, Hydra's `_target_`s, verl's profiler, tables switched off): every interpolation is
/// resolved, nothing is refused, and the TOML trains here; what the harness cannot follow
/// (another optimiser, a clip that differs from `grad_clip`, the original run's environment,
/// a feature switched on) is refused naming its key.
#[test]
fn a_hydra_saved_config_resolves_its_interpolations_and_trains() {
    let env = Env::new();
    tiny_llm(&env, 32, 8);
    let (ok, err) = convert(&env, "hydra_config.yaml", "hydra.toml");
    assert!(ok, "{err}");
    assert!(err.contains(", 0 refused;"), "{err}");
    for line in [
        // interpolations: relative, absolute, oc.select with and without the key, inside text
        "mapped      critic.ppo_mini_batch_size = 8",
        "mapped      trainer.experiment_name = \"hydra_verl_grpo_example\"",
        "mapped      actor_rollout_ref.rollout.response_length = 8",
        "mapped      actor_rollout_ref.actor.tau_pos = 1.0",
        "no effect   actor_rollout_ref.actor.checkpoint.load_contents",
        "no effect   actor_rollout_ref.actor.use_remove_padding: verl's config copies it",
        "no effect   actor_rollout_ref.actor._target_: Hydra's class",
        "no effect   global_profiler.save_path: verl's profiler",
        "no effect   actor_rollout_ref.model.mtp.num_speculative_tokens: under `actor_rollout_ref.model.mtp`",
        "no effect   algorithm.pf_ppo.weight_pow: under `algorithm.pf_ppo`",
        "no effect   actor_rollout_ref.model.use_liger: false, null or empty",
        "no effect   actor_rollout_ref.actor.optim.optimizer: the optimiser here is AdamW",
        "no effect   actor_rollout_ref.actor.optim.clip_grad: the clip here is `actor_rollout_ref.actor.grad_clip` (1), the same",
        "no effect   actor_rollout_ref.actor.router_replay.mode",
    ] {
        assert!(err.contains(line), "lacks {line:?}: {err}");
    }
    env.ok(&[
        "train",
        "hydra.toml",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
    ]);
    let yaml = env.file(
        "other.yaml",
        "actor_rollout_ref:\n  actor:\n    grad_clip: 1.0\n    optim:\n      optimizer: SGD\n      \
         clip_grad: 0.5\n    router_replay:\n      mode: R3\n  model:\n    use_liger: true\n\
         trainer:\n  default_local_dir: ${oc.env:HOME}/ckpt\n  project_name: ${no.such.key}\n",
    );
    let out = env.run(&["config", "from-verl", yaml.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    for line in [
        "refused     actor_rollout_ref.actor.optim.optimizer: only `AdamW` is followed here",
        "refused     actor_rollout_ref.actor.optim.clip_grad: `0.5` differs from `actor_rollout_ref.actor.grad_clip` (1)",
        "refused     actor_rollout_ref.actor.router_replay.mode: only `disabled`",
        "refused     actor_rollout_ref.model.use_liger: not a key of this harness",
        "refused     trainer.default_local_dir: an interpolation not resolved here (the resolver `oc.env`",
        "refused     trainer.project_name: an interpolation not resolved here (`${no.such.key}` names no key",
        "6 verl key(s) refused",
    ] {
        assert!(err.contains(line), "lacks {line:?}: {err}");
    }
}

/// verl's SFT trainer (`fsdp_sft_trainer`, its gsm8k example with LoRA): the question and
/// answer inside `extra_info` become `sft.prompt_key`/`sft.response_key` paths, verl's SFT
/// defaults are written out (cosine with 10% warmup, betas (0.9, 0.95), 1024 tokens), nothing is
/// refused, and the TOML trains here with the cosine spanning the run. Over-long examples and a
/// field that is not there are errors naming the file, row and key.
#[test]
fn verls_sft_command_line_converts_and_trains_with_its_schedule() {
    let env = Env::new();
    tiny_llm(&env, 32, 8);
    let (ok, err) = convert(&env, "sft_gsm8k.sh", "sft.toml");
    assert!(ok, "{err}");
    assert!(err.contains(", 0 refused;"), "{err}");
    for line in [
        "mapped      trainer.algorithm = \"sft\" (the entry point)",
        "mapped      sft.prompt_key = \"extra_info.question\" (verl's data.prompt_key with data.prompt_dict_keys)",
        "mapped      sft.response_key = \"extra_info.answer\" (verl's data.response_key with data.response_dict_keys)",
        "mapped      actor_rollout_ref.model.path = \"models/tiny-llama\" (verl's model.partial_pretrain)",
        "mapped      actor_rollout_ref.model.lora_rank = 32 (verl's model.lora_rank)",
        "mapped      actor_rollout_ref.model.use_remove_padding = true (verl's use_remove_padding)",
        "mapped      actor_rollout_ref.actor.optim.lr_scheduler_type = \"cosine\" (verl's SFT default)",
        "mapped      actor_rollout_ref.actor.optim.lr_warmup_steps_ratio = 0.1 (verl's SFT default)",
        "mapped      sft.max_length = 1024 (verl's SFT default)",
        "mapped      actor_rollout_ref.actor.ppo_mini_batch_size = 8 (the batch: verl's SFT trainer takes one optimiser step per batch)",
    ] {
        assert!(err.contains(line), "lacks {line:?}: {err}");
    }
    assert!(!err.contains("critic."), "{err}");
    // 4 steps, no warmup (int(0.4) = 0), then lr 1e-4 x (1 + cos(pi k / 4)) / 2
    let run = env.run(&[
        "train",
        "sft.toml",
        "trainer.total_training_steps=4",
        "trainer.test_freq=4",
    ]);
    // the step lines are the progress on stderr
    let out = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success(), "{out}");
    for lr in ["1.000e-4", "8.536e-5", "5.000e-5", "1.464e-5"] {
        assert!(out.contains(&format!("actor/lr:{lr} ")), "lr {lr}: {out}");
    }
    assert!(out.contains("val/loss"), "{out}");
    // an example longer than sft.max_length: an error naming the file, row and key; cut
    // from the right it trains
    let e = env.fails(&["train", "sft.toml", "sft.max_length=4"]);
    assert!(
        e.contains("data/tiny-addition/") && e.contains("row ") && e.contains("sft.max_length = 4"),
        "{e}"
    );
    env.ok(&[
        "train",
        "sft.toml",
        "sft.max_length=12",
        "sft.truncation=right",
        "trainer.total_training_steps=1",
    ]);
    // no validation files (verl's engine default): no validation, and no figure made up
    let run = env.run(&[
        "train",
        "sft.toml",
        "data.val_files=[]",
        "trainer.total_training_steps=2",
        "trainer.test_freq=1",
    ]);
    let out = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(run.status.success() && out.contains("step:2/2"), "{out}");
    assert!(!out.contains("val/loss"), "{out}");
    let e = env.fails(&["train", "sft.toml", "sft.prompt_key=extra_info.query"]);
    assert!(
        e.contains(
            ".parquet: row 0, column `extra_info`: expected a field `query`, got the fields"
        ) && e.contains("question"),
        "{e}"
    );
    let e = env.fails(&["train", "sft.toml", "sft.response_key=extra_info."]);
    assert!(e.contains("config key `sft.response_key`"), "{e}");
}

/// verl's engine SFT trainer on conversations (`data.messages_key`), from its e2e script:
/// converted with the two things it asks for that are not followed here refused, it trains, and
/// every assistant turn of a conversation is trained and nothing else.
#[test]
fn verls_engine_sft_trains_the_assistant_turns_of_conversations() {
    use rl_core::keys;
    use rl_data::{Message, RlRecord};
    use rl_harness::run::compose::{SftSource, sft_train_rows};
    use std::sync::Arc;

    let env = Env::new();
    tiny_llm(&env, 8, 4);
    let convo = |a: u32, b: u32| RlRecord {
        data_source: "arithmetic".into(),
        prompt: vec![
            Message::user(format!("{a}+{b}=")),
            Message::assistant(format!("{}", a + b)),
            Message::user(format!("{b}+{a}=")),
            Message::assistant(format!("{}", a + b)),
        ],
        ability: "math".into(),
        style: "rule".into(),
        ground_truth: serde_json::Value::Null,
        extra_info: serde_json::Map::new(),
    };
    let rows: Vec<RlRecord> = (0..8).map(|i| convo(10 + i, 21 + 2 * i)).collect();
    std::fs::create_dir_all(env.path().join("chat")).unwrap();
    for f in ["chat/train.parquet", "chat/test.parquet"] {
        rl_data::write_rl_parquet(&env.path().join(f), &rows).unwrap();
    }
    let (ok, err) = convert(&env, "sft_engine.sh", "chat.toml");
    assert!(!ok, "{err}");
    for line in [
        "mapped      trainer.algorithm = \"sft\" (the entry point)",
        "mapped      sft.messages_key = \"prompt\" (verl's data.messages_key)",
        "mapped      actor_rollout_ref.actor.use_dynamic_bsz = true (verl's data.use_dynamic_bsz)",
        "mapped      actor_rollout_ref.actor.optim.min_lr_ratio = 0.1 (verl's optim.min_lr_ratio)",
        "mapped      actor_rollout_ref.actor.ppo_mini_batch_size = 4 (the batch",
        "no effect   engine: Hydra's choice of verl's training engine",
        "no effect   data.pad_mode: the batch layout follows",
        "no effect   actor_rollout_ref.actor.fsdp_config.fsdp_size: FSDP is set here by `zero_stage`",
        "refused     trainer.test_freq: `after_each_epoch` is not followed here",
        "refused     trainer.logger: config key `trainer.logger`: `file` is not written",
        ", 2 refused;",
    ] {
        assert!(err.contains(line), "lacks {line:?}: {err}");
    }
    let toml = env.path().join("chat.toml");
    let out = env.ok(&["train", toml.to_str().unwrap(), "trainer.test_freq=2"]);
    assert!(out.contains("val/loss"), "{out}");

    // the batches it trains on: the loss mask covers the two answers (and their ends of turn)
    let cfg = rl_harness::config::load(&rl_harness::config::Sources {
        file: Some(toml.clone()),
        env: false,
        overrides: vec![],
    })
    .unwrap();
    let mut cfg = cfg;
    for f in cfg
        .data
        .train_files
        .iter_mut()
        .chain(cfg.data.val_files.iter_mut())
    {
        *f = env.path().join(&*f);
    }
    let tok = Arc::new(rl_data::Tokenizer::from_dir(env.path().join("models/tiny-llama")).unwrap());
    let mut source =
        SftSource::new(Arc::new(sft_train_rows(&cfg).unwrap()), tok.clone(), 4, 5).unwrap();
    let batch = rl_algos::trainer::BatchSource::next_batch(&mut source).unwrap();
    let ids = Vec::<Vec<i64>>::try_from(batch.get(keys::INPUT_IDS).unwrap()).unwrap();
    let loss = Vec::<Vec<i64>>::try_from(batch.get(keys::LOSS_MASK).unwrap()).unwrap();
    for (ids, loss) in ids.iter().zip(&loss) {
        let trained: Vec<u32> = ids
            .iter()
            .zip(loss)
            .filter(|(_, m)| **m == 1)
            .map(|(t, _)| *t as u32)
            .collect();
        let text = tok.decode(&trained, false).unwrap();
        let whole = tok
            .decode(&ids.iter().map(|&t| t as u32).collect::<Vec<_>>(), false)
            .unwrap();
        let answer = whole
            .split("=")
            .nth(1)
            .and_then(|r| r.get(..2))
            .unwrap_or_else(|| panic!("{whole:?}"));
        assert!(
            text.matches(answer).count() == 2 && !text.contains('+') && !text.contains('='),
            "trained on {text:?} of {whole:?}"
        );
    }
    // SPIN answers single-turn prompts only
    let e = env.fails(&["train", toml.to_str().unwrap(), "trainer.algorithm=spin"]);
    assert!(e.contains("config key `sft.messages_key`"), "{e}");
}

/// verl's DAPO overlong buffer in its reward manager's `reward_kwargs` (as its current recipe
/// scripts write it) is this harness's `reward_model.overlong_buffer`, on a converted command
/// line and on `harness train`'s own; `max_resp_len` must be the run's maximum response
/// length; Megatron's engine and vLLM's engine arguments have no effect here.
#[test]
fn verls_reward_kwargs_and_megatron_keys_map() {
    let env = Env::new();
    let line = |max_resp_len: &str| {
        format!(
            "python3 -m verl.trainer.main_ppo data.max_response_length=8 \
             +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True \
             +reward_model.reward_kwargs.overlong_buffer_cfg.len=4 \
             +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
             reward_model.reward_kwargs.max_resp_len={max_resp_len} \
             actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 \
             +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform \
             actor_rollout_ref.ref.megatron.param_offload=True \
             actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True"
        )
    };
    let out = env.run(&["config", "from-verl", &line("8")]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stderr.contains(", 0 refused"),
        "{stderr}"
    );
    assert!(
        stdout.contains(
            "[reward_model.overlong_buffer]\nenable = true\nlen = 4\npenalty_factor = 1.0"
        ),
        "{stdout}"
    );
    for line in [
        "mapped      reward_model.overlong_buffer.len = 4 (verl's reward_model.reward_kwargs.overlong_buffer_cfg.len)",
        "no effect   reward_model.reward_kwargs.max_resp_len: the overlong penalty is measured against data.max_response_length (8), the same",
        "no effect   actor_rollout_ref.actor.megatron.tensor_model_parallel_size: verl's Megatron engine",
        "no effect   actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method: verl's Megatron engine",
        "no effect   actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache: arguments of verl's vLLM or SGLang engine",
    ] {
        assert!(stderr.contains(line), "lacks {line:?}: {stderr}");
    }
    let err = env.fails(&["config", "from-verl", &line("16")]);
    assert!(
        err.contains(
            "refused     reward_model.reward_kwargs.max_resp_len: `16` differs from \
             data.max_response_length (8)"
        ),
        "{err}"
    );
    // `harness train`'s command line takes verl's name too
    let toml = env.file("d.toml", "[trainer]\nseed = 1\n");
    let shown = env.ok(&[
        "config",
        "show",
        toml.to_str().unwrap(),
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=6",
    ]);
    assert!(shown.contains("len = 6"), "{shown}");
}
