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
