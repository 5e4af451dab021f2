//! `harness serve` through the binary, talked to by the official OpenAI Python client
//! (`scripts/client-env`) and by curl: the client sees `generate()`'s greedy token ids, seeded
//! chat samples, the same text streamed, and our errors as its own exception.

mod common;

use std::path::Path;
use std::process::Command;

use common::{Env, repo_root};
use serde_json::{Value, json};
use tch::{Device, Kind, Tensor};

const PROMPT: [i64; 6] = [22, 23, 16, 24, 25, 34];

/// `generate()`'s greedy response ids for `PROMPT` (no stop token: the requests `ignore_eos`).
fn greedy_ids(model: &Path, max: i64) -> Vec<i64> {
    let lm = rl_workers::CausalLm::from_pretrained(model, Device::Cpu, Kind::Float).unwrap();
    let len = PROMPT.len() as i64;
    let ids = Tensor::from_slice(&PROMPT).view([1, len]);
    let mask = Tensor::ones([1, len], (Kind::Int64, Device::Cpu));
    let pos = Tensor::arange(len, (Kind::Int64, Device::Cpu)).view([1, len]);
    let cfg = rl_workers::RolloutConfig {
        do_sample: false,
        response_length: max,
        ..rl_workers::RolloutConfig::default()
    };
    let mut opts = rl_workers::GenerateOptions::from_config(lm.config());
    opts.eos_token_ids = Vec::new();
    let out = rl_workers::generate(&lm, &ids, &mask, &pos, &cfg, &mut opts).unwrap();
    Vec::<i64>::try_from(&out.responses.view([-1])).unwrap()
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect()
}

#[test]
fn the_openai_client_and_curl_get_generates_tokens() {
    let python = repo_root().join(".venv-client/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/client-env first (scripts/test does)",
        python.display()
    );
    let env = Env::new();
    env.ok(&["model", "init-tiny", "tiny", "--seed", "7"]);
    let (_server, base) = common::spawn_server(
        &env,
        &["serve", "tiny", "--port", "0", "--max-batch", "8"],
        "/v1",
    );
    let want = greedy_ids(&env.path().join("tiny"), 8);

    let out = Command::new(&python)
        .arg(repo_root().join("rl-harness/tests/serve/client.py"))
        .args([&base, &json!(PROMPT).to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the client failed:\n{stderr}");
    let seen: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}\n{stderr}", String::from_utf8_lossy(&out.stdout)));

    assert_eq!(seen["models"], json!(["tiny"]));
    let greedy = &seen["greedy"];
    assert_eq!(ids(&greedy["token_ids"]), want, "{greedy}");
    assert_eq!(ids(&greedy["prompt_token_ids"]), PROMPT);
    assert_eq!(greedy["finish_reason"], "length");
    assert_eq!(greedy["usage"]["completion_tokens"], 8);
    let lps = greedy["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), 8);
    assert!(lps.iter().all(|l| l.as_f64().unwrap() <= 0.0));

    let chat = seen["chat"].as_array().unwrap();
    assert_eq!(chat.len(), 2);
    for c in chat {
        assert_eq!(c["role"], "assistant");
        assert_eq!(
            c["logprobs"].as_array().unwrap().len(),
            ids(&c["token_ids"]).len()
        );
    }
    assert_ne!(
        chat[0]["token_ids"], chat[1]["token_ids"],
        "n samples differ"
    );
    let contents: Vec<&Value> = chat.iter().map(|c| &c["content"]).collect();
    assert_eq!(seen["chat_streamed"]["contents"], json!(contents));
    let finishes: Vec<&Value> = chat.iter().map(|c| &c["finish_reason"]).collect();
    assert_eq!(seen["chat_streamed"]["finish_reasons"], json!(finishes));

    assert_eq!(seen["bad_request"]["status"], 400);
    let message = seen["bad_request"]["message"].as_str().unwrap();
    assert!(message.contains("presence_penalty"), "{message}");

    // curl, as a shell script would call it
    if Command::new("curl").arg("--version").output().is_err() {
        eprintln!("SKIPPED the curl half of this test: curl is not installed");
        return;
    }
    let body = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": true, "ignore_eos": true});
    let curl = Command::new("curl")
        .args([
            "-sS",
            "--fail-with-body",
            "-H",
            "Content-Type: application/json",
            "-d",
        ])
        .arg(body.to_string())
        .arg(format!("{base}/completions"))
        .output()
        .unwrap();
    assert!(
        curl.status.success(),
        "{}",
        String::from_utf8_lossy(&curl.stderr)
    );
    let r: Value = serde_json::from_slice(&curl.stdout).unwrap();
    assert_eq!(ids(&r["choices"][0]["token_ids"]), want, "{r}");
}

/// Issue 23's loop in CI: GRPO generating on `harness serve` (`rollout.server_url`), the
/// policy's weights synced into it before every step (through SGLang's route, and through
/// vLLM's pause/start/update/finish/resume sequence with the weight checker's digests
/// compared), equals GRPO on the in-process engine
/// metric for metric (the server samples each row from the stream the in-process engine would;
/// the trained log-probs are the actor's either way), so every step's samples came from the
/// weights just trained; at the end the server holds the exported policy's weights. And one
/// step off-policy (`async_training`), the background rollout generating on the server while
/// the actor trains, equals the same asynchronous run on the in-process engine.
#[test]
fn grpo_on_a_served_engine_syncs_every_step_and_equals_in_process_grpo() {
    let env = Env::new();
    common::tiny_llm(&env, 64, 16);
    let (_server, base) =
        common::spawn_server(&env, &["serve", "models/tiny-llama", "--port", "0"], "/v1");
    let root = base.trim_end_matches("/v1").to_owned();
    let grpo = repo_root().join("experiments/quickstart.toml");
    let train = |name: &str, extra: &[String]| {
        let mut args: Vec<String> = [
            "train",
            grpo.to_str().unwrap(),
            "actor_rollout_ref.model.path=models/tiny-llama",
            "trainer.total_training_steps=3",
            "trainer.test_freq=3",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            // a random model scores 0, so its advantages are 0: the entropy bonus is what
            // moves its weights every step, and so what a missed sync would show
            "actor_rollout_ref.actor.entropy_coeff=0.1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(format!("trainer.experiment_name={name}"));
        args.extend(extra.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        env.ok(&args);
    };
    train("in-process", &[]);
    // SGLang's route first, then vLLM's sequence (rollout.name's default, as verl's), which
    // leaves its weight version on the server
    for name in ["sglang", "vllm"] {
        train(
            &format!("served-{name}"),
            &[
                format!("actor_rollout_ref.rollout.server_url=[\"{root}\"]"),
                format!("actor_rollout_ref.rollout.name={name}"),
                "actor_rollout_ref.rollout.weight_sync_dir=sync".to_owned(),
            ],
        );
    }
    let (rt, store) = env.store();
    let metrics = |name: &str| {
        let run = rt.block_on(store.resolve_run(name)).unwrap();
        common::metrics_of(&rt, &store, run.id)
    };
    let same = |local: &str, name: &str| {
        let (local, served) = (metrics(local), metrics(name));
        assert_eq!(local.len(), served.len());
        for ((s1, k1, v1), (s2, k2, v2)) in local.iter().zip(&served) {
            assert_eq!((s1, k1), (s2, k2));
            let (a, b) = (f64::from_bits(*v1), f64::from_bits(*v2));
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                "step {s1} {k1}: in-process {a}, {name} {b}"
            );
        }
    };
    let local = metrics("in-process");
    for name in ["served-sglang", "served-vllm"] {
        same("in-process", name);
    }
    // the vLLM run synced through vLLM's routes: its finish_weight_update calls left the
    // policy version, the trainer's step (the final validation's: 3), which SGLang's route
    // never sets
    let info: Value = reqwest::blocking::get(format!("{root}/weight_info"))
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(info["weight_version"], "3", "{info}");
    assert!(
        local
            .iter()
            .any(|(s, k, _)| *s == 3 && k == "actor/kl_loss")
    );
    let initial = rl_workers::CausalLm::from_pretrained(
        env.path().join("models/tiny-llama"),
        Device::Cpu,
        Kind::Float,
    )
    .unwrap();
    // the last validation synced the final weights: the server holds the exported policy
    let exported = rt.block_on(store.resolve_run("served-vllm")).unwrap();
    let dir = env
        .path()
        .join(format!("runs/{}-served-vllm/model", exported.id));
    let lm = rl_workers::CausalLm::from_pretrained(&dir, Device::Cpu, Kind::Float).unwrap();
    let held: Value = reqwest::blocking::get(format!("{root}/weights_checksum"))
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(held["sha256"], lm.weights_sha256());
    assert_ne!(
        lm.weights_sha256(),
        initial.weights_sha256(),
        "training moved the weights"
    );

    let off_policy = [
        "async_training.enable=true".to_owned(),
        "async_training.max_staleness=1".to_owned(),
        "algorithm.rollout_correction.bypass_mode=true".to_owned(),
    ];
    train("in-process-async", &off_policy);
    let mut served = off_policy.to_vec();
    served.extend([
        format!("actor_rollout_ref.rollout.server_url=[\"{root}\"]"),
        "actor_rollout_ref.rollout.weight_sync_dir=sync-async".to_owned(),
    ]);
    train("served-async", &served);
    // the background rollout synced the server from its own folder
    assert!(env.path().join("sync-async/model.safetensors").is_file());
    same("in-process-async", "served-async");
    let staleness: Vec<f64> = metrics("served-async")
        .iter()
        .filter(|(_, k, _)| k == "async/staleness")
        .map(|(_, _, v)| f64::from_bits(*v))
        .collect();
    assert_eq!(staleness, vec![0.0, 1.0, 1.0]);
}

/// A rollout server that is not there fails the run at once, naming the setting and the
/// address; one that refuses the request fails it with the server's own text.
#[test]
fn an_unreachable_or_refusing_rollout_server_is_named() {
    let env = Env::new();
    common::tiny_llm(&env, 16, 8);
    let (_server, base) =
        common::spawn_server(&env, &["serve", "models/tiny-llama", "--port", "0"], "/v1");
    let grpo = repo_root().join("experiments/quickstart.toml");
    let fails = |url: &str, extra: &[&str]| {
        let server = format!("actor_rollout_ref.rollout.server_url=[\"{url}\"]");
        let out = env
            .cmd()
            .args([
                "train",
                grpo.to_str().unwrap(),
                "actor_rollout_ref.model.path=models/tiny-llama",
                "trainer.total_training_steps=1",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.rollout.server_timeout_s=20",
                &server,
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // a port nobody listens on: the listener is dropped before the run
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let err = fails(&url, &[]);
    assert!(err.contains("server_url") && err.contains(&url), "{err}");
    // responses longer than the served model's context: the server's 400, word for word
    let err = fails(
        base.trim_end_matches("/v1"),
        &[
            "actor_rollout_ref.rollout.response_length=300",
            "data.max_response_length=300",
        ],
    );
    assert!(
        err.contains("/v1/completions") && err.contains("`max_tokens`: 300"),
        "{err}"
    );
}
