//! `harness serve` over real HTTP on a tiny model: greedy and seeded output equal `generate`'s,
//! stop strings, streaming, errors and the full queue.

use std::path::Path;

use reqwest::blocking::Client;
use serde_json::{Value, json};
use tch::{Device, Kind, Tensor};

use super::*;

fn tiny(dir: &Path) -> CausalLm {
    crate::run::compose::init_tiny(dir, 7, 0.0).unwrap();
    CausalLm::from_pretrained(dir, Device::Cpu, Kind::Float).unwrap()
}

fn server(dir: &Path, max_batch: usize, max_queue: usize) -> ServerHandle {
    start(
        dir,
        &ServeOptions {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            max_batch,
            max_queue,
            ..ServeOptions::default()
        },
    )
    .unwrap()
}

fn post(s: &ServerHandle, path: &str, body: &Value) -> (u16, Value) {
    let r = Client::new()
        .post(format!("{}{path}", s.base_url()))
        .json(body)
        .send()
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap())
}

/// `generate` on one prompt: the `n` rows' response ids (up to each row's stop).
fn generate_ids(
    lm: &CausalLm,
    prompt: &[i64],
    max: i64,
    temperature: f64,
    seed: u64,
    n: usize,
) -> Vec<Vec<i64>> {
    let len = prompt.len() as i64;
    let ids = Tensor::from_slice(prompt).view([1, len]);
    let mask = Tensor::ones([1, len], (Kind::Int64, Device::Cpu));
    let pos = Tensor::arange(len, (Kind::Int64, Device::Cpu)).view([1, len]);
    let cfg = rl_workers::RolloutConfig {
        n,
        temperature,
        do_sample: temperature > 0.0,
        response_length: max,
        ..rl_workers::RolloutConfig::default()
    };
    let mut opts = rl_workers::GenerateOptions::from_config(lm.config());
    // the requests say `ignore_eos`
    opts.eos_token_ids = Vec::new();
    opts.seed = seed;
    let out = rl_workers::generate(lm, &ids, &mask, &pos, &cfg, &mut opts).unwrap();
    let responses = Vec::<Vec<i64>>::try_from(&out.responses).unwrap();
    let masks = Vec::<Vec<f32>>::try_from(&out.response_mask).unwrap();
    responses
        .into_iter()
        .zip(masks)
        .map(|(r, m)| {
            r.into_iter()
                .zip(m)
                .filter(|(_, m)| *m > 0.0)
                .map(|(t, _)| t)
                .collect()
        })
        .collect()
}

fn token_ids(choice: &Value) -> Vec<i64> {
    choice["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect()
}

#[test]
fn greedy_and_seeded_completions_are_generates_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let lm = tiny(dir.path());
    let s = server(dir.path(), 4, 64);
    let prompts: [&[i64]; 3] = [
        &[22, 23, 16, 24, 25, 34],
        &[5, 6],
        &[30, 31, 32, 33, 12, 13, 14, 40, 41],
    ];
    // concurrent requests of different lengths share the batch, greedy
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let url = format!("{}/completions", s.base_url());
            let body = json!({"prompt": p, "max_tokens": 12, "temperature": 0, "return_token_ids": true, "ignore_eos": true});
            std::thread::spawn(move || -> Value { Client::new().post(url).json(&body).send().unwrap().json().unwrap() })
        })
        .collect();
    for (p, h) in prompts.iter().zip(handles) {
        let r = h.join().unwrap();
        let choice = &r["choices"][0];
        let want = &generate_ids(&lm, p, 12, 0.0, 0, 1)[0];
        assert_eq!(&token_ids(choice), want, "{r}");
        assert_eq!(choice["prompt_token_ids"], json!(p));
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(r["usage"]["completion_tokens"], 12);
    }
    // n samples with a seed are generate's n rows with that seed
    let (status, r) = post(
        &s,
        "/completions",
        &json!({"prompt": prompts[0], "max_tokens": 8, "n": 3, "seed": 11, "return_token_ids": true, "ignore_eos": true, "logprobs": 1}),
    );
    assert_eq!(status, 200, "{r}");
    let want = generate_ids(&lm, prompts[0], 8, 1.0, 11, 3);
    for (i, w) in want.iter().enumerate() {
        let choice = &r["choices"][i];
        assert_eq!(&token_ids(choice), w, "sample {i}");
        let lps = choice["logprobs"]["token_logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), w.len());
        assert!(lps.iter().all(|l| l.as_f64().unwrap() <= 0.0));
    }
    assert_ne!(want[0], want[1]);
}

#[test]
fn stop_strings_streaming_and_chat() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path());
    let s = server(dir.path(), 8, 64);
    let body = json!({"prompt": "12+34=", "max_tokens": 20, "seed": 5, "ignore_eos": true});
    let (_, full) = post(&s, "/completions", &body);
    let text = full["choices"][0]["text"].as_str().unwrap().to_owned();
    assert_eq!(text.chars().count(), 20, "{full}");
    // a stop string from the middle of that text ends it there
    let stop: String = text.chars().skip(6).take(2).collect();
    let mut stopped_body = body.clone();
    stopped_body["stop"] = json!([stop]);
    let (_, stopped) = post(&s, "/completions", &stopped_body);
    let cut = &stopped["choices"][0];
    assert_eq!(cut["finish_reason"], "stop", "{stopped}");
    assert_eq!(
        cut["text"].as_str().unwrap(),
        &text[..text.find(&stop).unwrap()]
    );
    // streamed: the deltas add up to the same text, one chunk a token, then [DONE]
    let mut streamed_body = body.clone();
    streamed_body["stream"] = json!(true);
    let raw = Client::new()
        .post(format!("{}/completions", s.base_url()))
        .json(&streamed_body)
        .send()
        .unwrap()
        .text()
        .unwrap();
    let events: Vec<&str> = raw
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap())
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks.len(), 20);
    let joined: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(joined, text);
    assert_eq!(chunks[19]["choices"][0]["finish_reason"], "length");
    // chat: the template rendered as training renders it, the reply as a message
    let (status, chat) = post(
        &s,
        "/chat/completions",
        &json!({"messages": [{"role": "user", "content": "12+34="}], "max_tokens": 5, "seed": 1, "logprobs": true, "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{chat}");
    let choice = &chat["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let prompt_ids: Vec<u32> = choice["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let rendered = tok
        .apply_chat_template(&[rl_data::Message::user("12+34=")], true)
        .unwrap();
    assert_eq!(tok.decode(&prompt_ids, false).unwrap(), rendered);
    assert_eq!(
        choice["logprobs"]["content"].as_array().unwrap().len(),
        token_ids(choice).len()
    );
}

#[test]
fn bad_requests_are_named_and_a_full_server_says_429() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path());
    let s = server(dir.path(), 1, 2);
    for (path, body, needle) in [
        ("/completions", json!({"max_tokens": 3}), "prompt"),
        (
            "/completions",
            json!({"prompt": "1", "max_tokens": 0}),
            "max_tokens",
        ),
        ("/completions", json!({"prompt": "1", "top_p": 0}), "top_p"),
        ("/completions", json!({"prompt": [1, 999]}), "999"),
        (
            "/completions",
            json!({"prompt": "1", "logprobs": 5}),
            "logprobs",
        ),
        (
            "/completions",
            json!({"prompt": "1", "model": "other"}),
            "model",
        ),
        (
            "/completions",
            json!({"prompt": "1", "frequency_penalty": 1.0}),
            "frequency_penalty",
        ),
        (
            "/completions",
            json!({"prompt": "1", "max_tokens": 100000}),
            "max_tokens",
        ),
        ("/chat/completions", json!({"messages": []}), "messages"),
        ("/chat/completions", json!({"prompt": "1"}), "prompt"),
    ] {
        let (status, r) = post(&s, path, &body);
        assert_eq!(status, 400, "{body}: {r}");
        let message = r["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body}: {message}");
    }
    let r = Client::new()
        .get(format!("{}/nope", s.base_url()))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);
    // two long samples fill the queue of 2 (streamed: once the headers are back they are in
    // flight): another request is refused, and the two run to their end
    let long = Client::new()
        .post(format!("{}/completions", s.base_url()))
        .json(
            &json!({"prompt": "1", "max_tokens": 250, "n": 2, "ignore_eos": true, "stream": true}),
        )
        .send()
        .unwrap();
    assert_eq!(long.status().as_u16(), 200);
    let (status, refused) = post(&s, "/completions", &json!({"prompt": "2", "max_tokens": 1}));
    assert_eq!(status, 429, "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-queue")
    );
    let streamed = long.text().unwrap();
    assert_eq!(
        streamed.matches("\"finish_reason\":\"length\"").count(),
        2,
        "{streamed}"
    );
    assert_eq!(streamed.matches("\"text\"").count(), 500);
    // and once it drained, it serves again
    let (status, _) = post(&s, "/completions", &json!({"prompt": "2", "max_tokens": 1}));
    assert_eq!(status, 200);
}

#[test]
fn setup_errors_name_the_option() {
    let dir = tempfile::tempdir().unwrap();
    let missing = start(dir.path(), &ServeOptions::default()).unwrap_err();
    assert!(format!("{missing:#}").contains(&dir.path().display().to_string()));
    tiny(dir.path());
    let remote = ServeOptions {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        ..ServeOptions::default()
    };
    assert!(
        start(dir.path(), &remote)
            .unwrap_err()
            .to_string()
            .contains("--allow-remote")
    );
    let queue = ServeOptions {
        max_batch: 8,
        max_queue: 4,
        ..ServeOptions::default()
    };
    assert!(
        start(dir.path(), &queue)
            .unwrap_err()
            .to_string()
            .contains("--max-queue")
    );
    let s = server(dir.path(), 1, 1);
    let taken = ServeOptions {
        addr: s.addr(),
        ..ServeOptions::default()
    };
    assert!(
        format!("{:#}", start(dir.path(), &taken).unwrap_err()).contains(&s.addr().to_string())
    );
}

/// The whole loop of a trainer syncing weights: generate, load new weights from a folder,
/// compare the checksum, generate again: the output is the in-process engine's with the new
/// weights; a bad folder is a 400 naming it and leaves the server serving.
#[test]
fn weights_loaded_from_disk_are_what_the_next_requests_use() {
    let dir = tempfile::tempdir().unwrap();
    let old = tiny(&dir.path().join("old"));
    let new = {
        crate::run::compose::init_tiny(&dir.path().join("new"), 8, 0.0).unwrap();
        CausalLm::from_pretrained(dir.path().join("new"), Device::Cpu, Kind::Float).unwrap()
    };
    let s = server(&dir.path().join("old"), 4, 64);
    let prompt: [i64; 4] = [22, 23, 16, 24];
    // seeded sampling: two random tiny models may share their greedy output
    let seeded = json!({"prompt": prompt, "max_tokens": 10, "seed": 5, "return_token_ids": true, "ignore_eos": true});
    let ask = || token_ids(&post(&s, "/completions", &seeded).1["choices"][0]);
    let before = ask();
    assert_eq!(before, generate_ids(&old, &prompt, 10, 1.0, 5, 1)[0]);
    let get = |path: &str| -> Value {
        Client::new()
            .get(format!("http://{}{path}", s.addr()))
            .send()
            .unwrap()
            .json()
            .unwrap()
    };
    assert_eq!(get("/weights_checksum")["sha256"], old.weights_sha256());
    assert_eq!(
        get("/get_model_info")["model_path"],
        dir.path().join("old").display().to_string()
    );

    let url = format!("http://{}/update_weights_from_disk", s.addr());
    let r: Value = Client::new()
        .post(&url)
        .json(&json!({"model_path": dir.path().join("new")}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(r["success"], true, "{r}");
    let sha = new.weights_sha256();
    assert_eq!(r["weights_sha256"], sha);
    assert_ne!(sha, old.weights_sha256());
    assert_eq!(get("/weights_checksum")["sha256"], sha);
    let after = ask();
    assert_eq!(after, generate_ids(&new, &prompt, 10, 1.0, 5, 1)[0]);
    assert_ne!(before, after);

    let missing = dir.path().join("nowhere");
    let r = Client::new()
        .post(&url)
        .json(&json!({"model_path": missing}))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let r: Value = r.json().unwrap();
    assert_eq!(r["success"], false);
    assert!(r["message"].as_str().unwrap().contains("nowhere"), "{r}");
    assert_eq!(ask(), after, "a failed load changes nothing");
}

/// A call to one of vLLM's control-plane routes: the status and the JSON answer.
fn call(s: &ServerHandle, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let url = format!("http://{}{path}", s.addr());
    let c = Client::new();
    let req = match method {
        "GET" => c.get(url),
        _ => c.post(url),
    };
    let req = match body {
        Some(b) => req.json(b),
        None => req,
    };
    let r = req.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap())
}

/// The weight checker's digests without the rank prefix.
fn checker_digests(s: &ServerHandle) -> std::collections::BTreeMap<String, String> {
    let (status, r) = call(
        s,
        "POST",
        "/weight_checker",
        Some(&json!({"action": "checksum"})),
    );
    assert_eq!(status, 200, "{r}");
    r["checksums"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let name = k
                .strip_prefix(super::rlhf::RANK_PREFIX)
                .unwrap_or_else(|| panic!("{k} lacks the rank prefix"));
            (name.to_owned(), v.as_str().unwrap().to_owned())
        })
        .collect()
}

/// What a folder's tensors digest to, as the trainer computes it (the bytes as written).
fn folder(dir: &Path) -> std::collections::BTreeMap<String, String> {
    rl_workers::remote::folder_digests(dir)
        .unwrap()
        .into_iter()
        .map(|(k, d)| (k, d.written))
        .collect()
}

/// vLLM's weight-update cycle over HTTP (pause, init, start, update from a safetensors folder,
/// finish with a version, resume), then the weight checker: every tensor's digest is the new
/// folder's, and the next request samples what the in-process engine samples with the new
/// weights. Compare and reset do what vLLM's checker does.
#[test]
fn vllms_weight_transfer_cycle_loads_a_folder_and_the_checker_sees_it() {
    let dir = tempfile::tempdir().unwrap();
    let old = tiny(&dir.path().join("old"));
    crate::run::compose::init_tiny(&dir.path().join("new"), 8, 0.0).unwrap();
    let new = CausalLm::from_pretrained(dir.path().join("new"), Device::Cpu, Kind::Float).unwrap();
    let s = server(&dir.path().join("old"), 4, 64);
    let prompt: [i64; 4] = [22, 23, 16, 24];
    let seeded = json!({"prompt": prompt, "max_tokens": 10, "seed": 5, "return_token_ids": true, "ignore_eos": true});
    let ask = || token_ids(&post(&s, "/completions", &seeded).1["choices"][0]);
    assert_eq!(ask(), generate_ids(&old, &prompt, 10, 1.0, 5, 1)[0]);
    let before = checker_digests(&s);
    assert_eq!(before, folder(&dir.path().join("old")));

    let ok = |method: &str, path: &str, body: Option<Value>| {
        let (status, r) = call(&s, method, path, body.as_ref());
        assert_eq!(status, 200, "{path}: {r}");
        r
    };
    assert_eq!(ok("GET", "/is_paused", None), json!({"is_paused": false}));
    assert_eq!(
        ok("POST", "/pause?mode=wait", None),
        json!({"status": "paused"})
    );
    assert_eq!(ok("GET", "/is_paused", None), json!({"is_paused": true}));
    ok(
        "POST",
        "/init_weight_transfer_engine",
        Some(json!({"init_info": {}})),
    );
    ok("POST", "/start_weight_update", Some(json!({})));
    let path = std::path::absolute(dir.path().join("new")).unwrap();
    assert_eq!(
        ok(
            "POST",
            "/update_weights",
            Some(json!({"update_info": {"path": path}}))
        ),
        json!({"message": "Weights updated"})
    );
    ok(
        "POST",
        "/finish_weight_update",
        Some(json!({"weight_version": "step-1"})),
    );
    assert_eq!(ok("POST", "/resume", None), json!({"status": "resumed"}));
    assert_eq!(
        ok("GET", "/weight_info", None),
        json!({"weight_version": "step-1"})
    );
    let after = checker_digests(&s);
    assert_eq!(after, folder(&dir.path().join("new")));
    assert_ne!(after, before);
    assert_eq!(ask(), generate_ids(&new, &prompt, 10, 1.0, 5, 1)[0]);

    let baseline = ok(
        "POST",
        "/weight_checker",
        Some(json!({"action": "checksum"})),
    )["checksums"]
        .clone();
    let r = ok(
        "POST",
        "/weight_checker",
        Some(json!({"action": "compare", "baseline": baseline})),
    );
    assert_eq!(r["match"], true, "{r}");
    assert_eq!(r["ranks"], json!([super::rlhf::RANK_PREFIX]));
    assert_eq!(
        ok("POST", "/weight_checker", Some(json!({"action": "reset"}))),
        json!({"status": "reset"})
    );
    let r = ok(
        "POST",
        "/weight_checker",
        Some(json!({"action": "compare", "baseline": baseline})),
    );
    assert_eq!(r["match"], false, "{r}");
    assert_eq!(r["mismatches"].as_array().unwrap().len(), before.len());
    assert_eq!(ok("GET", "/get_world_size", None), json!({"world_size": 1}));
    assert_eq!(
        ok("GET", "/is_sleeping", None),
        json!({"is_sleeping": false})
    );
}

/// Out-of-order calls are 409s with vLLM's messages (a failed update ends its session, as
/// vLLM's disk backend's does); bad bodies are 400s naming the field; both in vLLM's error
/// body, and none changes the served weights.
#[test]
fn vllm_routes_refuse_bad_bodies_and_calls_out_of_order() {
    let dir = tempfile::tempdir().unwrap();
    let _old = tiny(&dir.path().join("old"));
    let s = server(&dir.path().join("old"), 4, 64);
    let before = checker_digests(&s);
    let refused = |path: &str, body: Value, status: u16, needle: &str| {
        let (got, r) = call(&s, "POST", path, Some(&body));
        assert_eq!(got, status, "{path} {body}: {r}");
        if status != 200 {
            let m = r["error"]["message"].as_str().unwrap_or_default();
            assert!(m.contains(needle), "{path} {body}: {r}");
            assert_eq!(r["error"]["code"], status, "{r}");
        }
    };
    let abs = std::path::absolute(dir.path().join("old")).unwrap();
    let update = json!({"update_info": {"path": abs}});
    refused(
        "/update_weights",
        update.clone(),
        409,
        "start_weight_update must be called",
    );
    refused(
        "/finish_weight_update",
        json!({}),
        409,
        "No shared-disk weight update is active",
    );
    refused("/start_weight_update", json!({}), 200, "");
    refused("/start_weight_update", json!({}), 409, "already active");
    refused(
        "/finish_weight_update",
        json!({}),
        409,
        "No checkpoint was loaded",
    );
    // that ended the session
    refused(
        "/finish_weight_update",
        json!({}),
        409,
        "No shared-disk weight update is active",
    );
    refused("/start_weight_update", json!({}), 200, "");
    refused("/update_weights", update.clone(), 200, "");
    refused(
        "/update_weights",
        update.clone(),
        409,
        "exactly one checkpoint",
    );
    refused(
        "/finish_weight_update",
        json!({}),
        409,
        "No shared-disk weight update is active",
    );

    // bad bodies
    refused(
        "/init_weight_transfer_engine",
        json!({}),
        400,
        "'init_info'",
    );
    refused(
        "/init_weight_transfer_engine",
        json!({"init_info": {"master_port": 1}}),
        400,
        "init_info.master_port",
    );
    refused("/update_weights", json!({}), 400, "'update_info'");
    refused(
        "/start_weight_update",
        json!({"is_checkpoint_format": false}),
        400,
        "is_checkpoint_format",
    );
    refused("/start_weight_update", json!({}), 200, "");
    refused(
        "/update_weights",
        json!({"update_info": {"path": "relative/dir"}}),
        400,
        "absolute",
    );
    // a failed update ends the session, as vLLM's disk backend's does
    refused(
        "/finish_weight_update",
        json!({}),
        409,
        "No shared-disk weight update is active",
    );
    refused("/start_weight_update", json!({}), 200, "");
    let empty = std::path::absolute(dir.path()).unwrap();
    refused(
        "/update_weights",
        json!({"update_info": {"path": empty}}),
        400,
        "no safetensors",
    );
    refused("/start_weight_update", json!({}), 200, "");
    refused(
        "/update_weights",
        json!({"update_info": {"path": abs, "names": []}}),
        400,
        "update_info.names",
    );
    refused(
        "/finish_weight_update",
        json!({"weight_version": 3}),
        400,
        "weight_version",
    );
    refused("/pause?mode=later", json!({}), 400, "`mode`");
    refused("/weight_checker", json!({"action": "sum"}), 400, "action");
    refused(
        "/weight_checker",
        json!({"action": "compare"}),
        400,
        "'baseline'",
    );
    refused("/update_weight_version", json!({}), 400, "'new_version'");
    assert_eq!(checker_digests(&s), before);
}

/// vLLM's pause: requests sent while paused wait in the queue and run after `/resume` exactly
/// as they would have; `mode=abort` ends every request in flight with `finish_reason: "abort"`;
/// a sample frozen by `mode=keep` mid-way goes on after `/resume` to exactly its tokens.
#[test]
fn pause_holds_aborts_or_freezes_requests_as_vllm_does() {
    let dir = tempfile::tempdir().unwrap();
    let lm = tiny(&dir.path().join("m"));
    let s = server(&dir.path().join("m"), 4, 64);
    let prompt: [i64; 4] = [22, 23, 16, 24];
    let want = generate_ids(&lm, &prompt, 12, 1.0, 3, 1)[0].clone();
    let body = json!({"prompt": prompt, "max_tokens": 12, "seed": 3, "return_token_ids": true, "ignore_eos": true});
    // until the request sent is admitted (a fixed sleep could end before it arrives on a
    // loaded machine, and an abort before it would leave it waiting for a resume forever)
    let admitted = || {
        let t = std::time::Instant::now();
        while s.in_flight() == 0 {
            assert!(
                t.elapsed().as_secs() < 120,
                "the request never reached the server"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    std::thread::scope(|sc| {
        // held while paused, then run
        assert_eq!(call(&s, "POST", "/pause?mode=keep", None).0, 200);
        let held = sc.spawn(|| post(&s, "/completions", &body));
        admitted();
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!held.is_finished(), "a paused server runs nothing");
        assert_eq!(call(&s, "POST", "/resume", None).0, 200);
        let (status, r) = held.join().unwrap();
        assert_eq!(status, 200, "{r}");
        assert_eq!(token_ids(&r["choices"][0]), want);

        // aborted
        assert_eq!(call(&s, "POST", "/pause?mode=keep", None).0, 200);
        let aborted = sc.spawn(|| post(&s, "/completions", &body));
        admitted();
        let (status, r) = call(&s, "POST", "/pause?mode=abort", None);
        assert_eq!((status, r), (200, json!({"status": "paused"})));
        let (status, r) = aborted.join().unwrap();
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "abort", "{r}");
        assert_eq!(call(&s, "POST", "/resume", None).0, 200);
    });

    // frozen mid-way by keep: a streamed greedy request read up to its first token
    use std::io::BufRead;
    let streamed = json!({"prompt": prompt, "max_tokens": 12, "seed": 3, "return_token_ids": true, "ignore_eos": true, "stream": true});
    let r = Client::new()
        .post(format!("{}/completions", s.base_url()))
        .json(&streamed)
        .send()
        .unwrap();
    let mut lines = std::io::BufReader::new(r).lines();
    let mut ids = Vec::new();
    let next_token = |lines: &mut std::io::Lines<_>| -> Option<Value> {
        for l in lines.by_ref() {
            let l: String = l.unwrap();
            if let Some(d) = l.strip_prefix("data: ") {
                if d == "[DONE]" {
                    return None;
                }
                return Some(serde_json::from_str(d).unwrap());
            }
        }
        None
    };
    let first = next_token(&mut lines).unwrap();
    ids.extend(token_ids(&first["choices"][0]));
    assert_eq!(call(&s, "POST", "/pause?mode=keep", None).0, 200);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(call(&s, "POST", "/resume", None).0, 200);
    while let Some(c) = next_token(&mut lines) {
        ids.extend(token_ids(&c["choices"][0]));
    }
    assert_eq!(ids, want);
}
