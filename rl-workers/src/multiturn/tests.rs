//! Tests of the multi-turn rollout on tiny random models, with a test codec whose token ids
//! decode to whole tags, so a random model calls tools, answers and stops often.

use std::sync::Mutex;

use tch::Device;

use super::*;
use crate::model::Config;
use crate::rollout::generate;

/// A codec over the 128 ids of `Config::tiny()`: `decode_one` decides what each id reads as;
/// text encodes letter by letter (`a`.. to 60..), anything else to id 3.
#[derive(Debug)]
struct Codec {
    decode_one: fn(i64) -> String,
}

impl TextCodec for Codec {
    fn encode(&self, text: &str) -> std::result::Result<Vec<i64>, String> {
        Ok(text
            .chars()
            .map(|c| {
                if c.is_ascii_lowercase() {
                    60 + (c as i64 - 'a' as i64)
                } else {
                    3
                }
            })
            .collect())
    }

    fn decode(&self, ids: &[i64]) -> std::result::Result<String, String> {
        Ok(ids.iter().map(|&i| (self.decode_one)(i)).collect())
    }
}

fn letter(id: i64) -> String {
    (b'a' + (id % 26) as u8).to_string()
}

/// A mix: `</t>`, `</answer>`, `<t>` and letters.
fn mixed(id: i64) -> String {
    match id {
        10..=24 => "</t>".into(),
        25..=29 => "</answer>".into(),
        40..=59 => "<t>".into(),
        0..=9 => " ".into(),
        _ => letter(id),
    }
}

/// A dictionary lookup: `t(arg)` doubles the argument; records every batch it is called with.
#[derive(Debug, Default)]
struct Lookup {
    name: &'static str,
    batches: Mutex<Vec<Vec<String>>>,
    fail: bool,
    short_by: usize,
}

impl Lookup {
    fn named(name: &'static str) -> Lookup {
        Lookup {
            name,
            ..Lookup::default()
        }
    }
}

impl Tool for Lookup {
    fn name(&self) -> &str {
        self.name
    }

    fn call(&self, arguments: &[String]) -> Vec<Observation> {
        self.batches.lock().unwrap().push(arguments.to_vec());
        let mut out: Vec<Observation> = arguments
            .iter()
            .map(|a| {
                if self.fail || a.trim().is_empty() {
                    Observation::failed(" no ")
                } else {
                    Observation::ok(format!(" {a}{a} "))
                }
            })
            .collect();
        out.truncate(out.len().saturating_sub(self.short_by));
        out
    }
}

/// Shares a tool between the env (which owns a box) and the test.
#[derive(Debug)]
struct Shared(Arc<Lookup>);

impl Tool for Shared {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn call(&self, arguments: &[String]) -> Vec<Observation> {
        self.0.call(arguments)
    }
}

/// A tiny model whose weights come from its own ChaCha8 stream (uniform, std 0.3), not from
/// libtorch's global generator, which other test threads reseed concurrently.
fn tiny(seed: u64) -> CausalLm {
    use rand::{RngExt, SeedableRng};
    let lm = CausalLm::new(&Config::tiny(), Device::Cpu, Kind::Float).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut vars: Vec<(String, Tensor)> = lm.var_store().variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let half_width = 0.3 * 3f64.sqrt();
    tch::no_grad(|| {
        for (name, mut t) in vars {
            let values: Vec<f32> = (0..t.numel())
                .map(|_| {
                    if name.ends_with("norm.weight") {
                        1.0
                    } else {
                        ((rng.random::<f64>() * 2.0 - 1.0) * half_width) as f32
                    }
                })
                .collect();
            t.copy_(&Tensor::from_slice(&values).view(t.size().as_slice()));
        }
    });
    lm
}

/// Four left-padded prompts of up to 6 tokens.
fn prompts() -> (Tensor, Tensor, Tensor) {
    let ids = Tensor::from_slice(&[
        5i64, 9, 17, 33, 4, 8, 0, 0, 11, 12, 13, 14, 0, 0, 0, 0, 40, 41, 0, 70, 71, 72, 73, 74,
    ])
    .view([4, 6]);
    let mask = ids.ne(0).to_kind(Kind::Int64);
    let pos = (mask.cumsum(1, Kind::Int64) - 1).clamp_min(0);
    (ids, mask, pos)
}

fn env(tool: &Arc<Lookup>, decode_one: fn(i64) -> String, cfg: MultiTurnConfig) -> ToolEnv {
    ToolEnv::new(
        vec![Box::new(Shared(tool.clone()))],
        Arc::new(Codec { decode_one }),
        cfg,
    )
    .unwrap()
}

fn greedy(response_length: i64, n: usize) -> RolloutConfig {
    RolloutConfig {
        n,
        do_sample: false,
        response_length,
        ..RolloutConfig::default()
    }
}

fn opts(eos: Vec<i64>) -> GenerateOptions<'static> {
    GenerateOptions {
        eos_token_ids: eos,
        pad_token_id: 0,
        seed: 7,
        row_offset: 0,
        progress: None,
    }
}

fn run(
    lm: &CausalLm,
    cfg: &RolloutConfig,
    env: &ToolEnv,
    eos: Vec<i64>,
) -> Result<MultiTurnOutput> {
    let (ids, mask, pos) = prompts();
    generate_multi_turn(lm, &ids, &mask, &pos, cfg, env, &mut opts(eos))
}

/// Row `r`'s response tokens and which of them the model generated.
fn row(out: &MultiTurnOutput, r: i64) -> (Vec<i64>, Vec<bool>) {
    let o = &out.rollout;
    let len = o.response_mask.get(r).sum(Kind::Float).double_value(&[]) as i64;
    let tokens = Vec::<i64>::try_from(o.responses.get(r).narrow(0, 0, len)).unwrap();
    let prompt_len = o.prompts.size()[1];
    let generated = Vec::<i64>::try_from(out.loss_mask.get(r).narrow(0, prompt_len, len)).unwrap();
    (tokens, generated.iter().map(|&g| g == 1).collect())
}

/// The slow reference: one row at a time, every token from a full forward over the whole
/// history (no cache), the same stop rules read off the whole turn's text, one call per row.
fn reference(
    lm: &CausalLm,
    prompt: &[i64],
    tool: &Lookup,
    decode_one: fn(i64) -> String,
    cfg: &MultiTurnConfig,
    budget: usize,
    eos: &[i64],
) -> (Vec<i64>, Vec<bool>) {
    let codec = Codec { decode_one };
    let (mut tokens, mut generated) = (Vec::new(), Vec::new());
    let mut segment = 0;
    let mut calls = 0;
    while tokens.len() < budget {
        let seq: Vec<i64> = prompt.iter().chain(&tokens).copied().collect();
        let n = seq.len() as i64;
        let ids = Tensor::from_slice(&seq).view([1, n]);
        let mask = Tensor::ones([1, n], (Kind::Int64, Device::Cpu));
        let pos = Tensor::arange(n, (Kind::Int64, Device::Cpu)).view([1, n]);
        let hidden = tch::no_grad(|| lm.model().forward(&ids, &mask, &pos, None).unwrap());
        let logits = lm.logits(&hidden.get(0).get(n - 1)).to_kind(Kind::Float);
        let next = logits.argmax(-1, false).int64_value(&[]);
        tokens.push(next);
        generated.push(true);
        if eos.contains(&next) {
            break;
        }
        let text = codec.decode(&tokens[segment..]).unwrap();
        let (answer, call) = (text.find("</answer>"), text.find("</t>"));
        match (answer, call) {
            (Some(a), c) if c.is_none_or(|c| a + 9 <= c + 4) => break,
            (_, Some(end)) => {
                if calls == cfg.max_turns || tokens.len() >= budget {
                    break;
                }
                calls += 1;
                let obs = match text[..end].rfind("<t>") {
                    Some(start) => tool.call(&[text[start + 3..end].to_owned()]).remove(0),
                    None => {
                        Observation::failed("\n<error>a call is written <t>arguments</t></error>\n")
                    }
                };
                let ids = codec.encode(&obs.text).unwrap();
                let room = (budget - tokens.len()).min(cfg.max_obs_length as usize);
                for &id in ids.iter().take(room) {
                    tokens.push(id);
                    generated.push(false);
                }
                segment = tokens.len();
            }
            _ => {}
        }
    }
    (tokens, generated)
}

#[test]
fn cached_multi_turn_greedy_equals_re_encoding_the_history_every_token() {
    let lm = tiny(11);
    let tool = Arc::new(Lookup::named("t"));
    let mt = MultiTurnConfig {
        max_turns: 3,
        max_obs_length: 6,
    };
    let env = env(&tool, mixed, mt.clone());
    let budget = 48;
    let eos = vec![2];
    let out = run(&lm, &greedy(budget, 2), &env, eos.clone()).unwrap();
    let (ids, mask, _) = prompts();
    let check = Arc::new(Lookup::named("t"));
    let mut calls = 0;
    let mut observation = 0;
    for r in 0..8 {
        let p = r / 2;
        let prompt: Vec<i64> =
            Vec::<i64>::try_from(ids.get(p).masked_select(&mask.get(p).ne(0))).unwrap();
        let want = reference(&lm, &prompt, &check, mixed, &mt, budget as usize, &eos);
        assert_eq!(row(&out, r), want, "row {r}");
        calls += out.stats[r as usize].total_calls();
        observation += out.stats[r as usize].observation_tokens;
    }
    // the test is only worth something if rows called the tool (validly and not), got
    // observations and stopped at different turns for different reasons
    let valid: usize = out
        .stats
        .iter()
        .map(|s| s.total_calls() - s.failed_calls.values().sum::<usize>())
        .sum();
    assert!(
        calls >= 4 && valid >= 1 && observation > 0,
        "{:?}",
        out.stats
    );
    let stops: Vec<StopReason> = out.stats.iter().map(|s| s.stop).collect();
    assert!(stops.contains(&StopReason::Answer) && stops.contains(&StopReason::MaxTurns));
    let turns: std::collections::BTreeSet<usize> = out.stats.iter().map(|s| s.turns).collect();
    assert!(turns.len() >= 3, "{turns:?}");
}

#[test]
fn without_tool_calls_it_samples_exactly_what_generate_does() {
    let lm = tiny(12);
    let tool = Arc::new(Lookup::named("t"));
    let env = env(&tool, letter, MultiTurnConfig::default());
    let cfg = RolloutConfig {
        n: 3,
        response_length: 12,
        temperature: 0.9,
        top_k: 40,
        ..RolloutConfig::default()
    };
    let eos = vec![5, 70, 71];
    let (ids, mask, pos) = prompts();
    let mt =
        generate_multi_turn(&lm, &ids, &mask, &pos, &cfg, &env, &mut opts(eos.clone())).unwrap();
    let plain = generate(&lm, &ids, &mask, &pos, &cfg, &mut opts(eos)).unwrap();
    let o = &mt.rollout;
    assert!(o.responses.equal(&plain.responses));
    assert!(o.response_mask.equal(&plain.response_mask));
    assert!(o.input_ids.equal(&plain.input_ids));
    assert!(o.attention_mask.equal(&plain.attention_mask));
    assert!(o.position_ids.equal(&plain.position_ids));
    let lp = (&o.rollout_log_probs - &plain.rollout_log_probs)
        .abs()
        .max()
        .double_value(&[]);
    assert!(lp < 1e-5, "{lp}");
    // every response token was generated
    let prompt_len = o.prompts.size()[1];
    assert!(
        mt.loss_mask
            .narrow(1, prompt_len, 12)
            .to_kind(Kind::Float)
            .equal(&o.response_mask)
    );
    assert!(tool.batches.lock().unwrap().is_empty());
}

fn always_call(_: i64) -> String {
    "<t>q</t>".into()
}

fn always_close(_: i64) -> String {
    "</t>".into()
}

fn always_answer(_: i64) -> String {
    "</answer>".into()
}

#[test]
fn calls_of_a_turn_go_in_one_batch_and_observations_are_cut_to_max_obs_length() {
    let lm = tiny(13);
    let tool = Arc::new(Lookup::named("t"));
    let mt = MultiTurnConfig {
        max_turns: 2,
        max_obs_length: 3,
    };
    let out = run(&lm, &greedy(40, 1), &env(&tool, always_call, mt), vec![]).unwrap();
    // every row calls on its first token each turn: one batch of 4 per turn, max_turns turns
    let batches = tool.batches.lock().unwrap().clone();
    assert_eq!(batches, vec![vec!["q".to_string(); 4]; 2]);
    for r in 0..4 {
        let (tokens, generated) = row(&out, r);
        // call, 3 of the 4 observation tokens (" qq "), call, 3 more, then the third call
        // closes past max_turns and ends the row
        assert_eq!(
            generated,
            [true, false, false, false, true, false, false, false, true]
        );
        assert_eq!(&tokens[1..4], &[3, 76, 76]);
        let s = &out.stats[r as usize];
        assert_eq!(s.stop, StopReason::MaxTurns);
        assert_eq!((s.turns, s.total_calls(), s.valid_actions), (3, 2, 2));
        assert_eq!((s.generated_tokens, s.observation_tokens), (3, 6));
        assert!(s.failed_calls.is_empty());
    }
    // observation tokens carry no rollout log-prob
    let o = &out.rollout;
    assert_eq!(o.rollout_log_probs.get(0).double_value(&[1]), 0.0);
    assert_ne!(o.rollout_log_probs.get(0).double_value(&[0]), 0.0);
    let prompt_len = o.prompts.size()[1];
    assert!(o.input_ids.narrow(1, prompt_len, 40).equal(&o.responses));
}

#[test]
fn unparsable_and_failed_calls_are_counted_and_never_sent() {
    let lm = tiny(14);
    let tool = Arc::new(Lookup::named("t"));
    let mt = MultiTurnConfig {
        max_turns: 2,
        max_obs_length: 4,
    };
    let out = run(
        &lm,
        &greedy(40, 1),
        &env(&tool, always_close, mt.clone()),
        vec![],
    )
    .unwrap();
    // `</t>` without `<t>`: the rollout answers the call itself, the tool never sees it
    assert!(tool.batches.lock().unwrap().is_empty());
    for s in &out.stats {
        assert_eq!(s.calls["t"], 2);
        assert_eq!(s.failed_calls["t"], 2);
        assert_eq!(s.valid_actions, 0);
        assert_eq!(s.stop, StopReason::MaxTurns);
    }
    let down = Arc::new(Lookup {
        fail: true,
        ..Lookup::named("t")
    });
    let out = run(&lm, &greedy(40, 1), &env(&down, always_call, mt), vec![]).unwrap();
    assert_eq!(down.batches.lock().unwrap().len(), 2);
    assert!(out.stats.iter().all(|s| s.failed_calls["t"] == 2));
}

#[test]
fn rows_stop_at_the_answer_at_eos_and_at_the_budget() {
    let lm = tiny(15);
    let tool = Arc::new(Lookup::named("t"));
    let mt = MultiTurnConfig::default();
    let out = run(
        &lm,
        &greedy(10, 1),
        &env(&tool, always_answer, mt.clone()),
        vec![],
    )
    .unwrap();
    for s in &out.stats {
        assert_eq!(
            (s.stop, s.turns, s.generated_tokens, s.valid_actions),
            (StopReason::Answer, 1, 1, 1)
        );
    }
    let all: Vec<i64> = (0..128).collect();
    let out = run(&lm, &greedy(10, 1), &env(&tool, letter, mt.clone()), all).unwrap();
    assert!(out.stats.iter().all(|s| s.stop == StopReason::Eos));
    assert!(out.stats.iter().all(|s| s.generated_tokens == 1));
    let out = run(&lm, &greedy(10, 1), &env(&tool, letter, mt.clone()), vec![]).unwrap();
    assert!(out.stats.iter().all(|s| s.stop == StopReason::Length));
    assert!(out.stats.iter().all(|s| s.generated_tokens == 10));
    // an observation longer than the budget left is cut there and ends the row
    let out = run(&lm, &greedy(3, 1), &env(&tool, always_call, mt), vec![]).unwrap();
    for r in 0..4 {
        assert_eq!(row(&out, r).1, [true, false, false]);
        assert_eq!(out.stats[r as usize].stop, StopReason::Length);
    }
    assert!(tool.batches.lock().unwrap().len() == 1);
}

#[test]
fn a_tool_answering_the_wrong_number_of_calls_is_an_error_naming_it() {
    let lm = tiny(16);
    let tool = Arc::new(Lookup {
        short_by: 1,
        ..Lookup::named("t")
    });
    let err = run(
        &lm,
        &greedy(10, 1),
        &env(&tool, always_call, MultiTurnConfig::default()),
        vec![],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("tool `t` answered 3 observations for 4 calls"),
        "{err}"
    );
}

#[test]
fn bad_tool_names_and_limits_are_errors_naming_them() {
    let codec: Arc<dyn TextCodec> = Arc::new(Codec { decode_one: letter });
    let make = |names: &[&'static str], cfg: MultiTurnConfig| {
        let tools: Vec<Box<dyn Tool>> = names
            .iter()
            .map(|&n| Box::new(Lookup::named(n)) as Box<dyn Tool>)
            .collect();
        ToolEnv::new(tools, codec.clone(), cfg)
            .unwrap_err()
            .to_string()
    };
    let d = MultiTurnConfig::default();
    assert!(make(&["a", "a"], d.clone()).contains("two tools are named `a`"));
    assert!(make(&["answer"], d.clone()).contains("`answer`"));
    assert!(make(&["se arch"], d.clone()).contains("\"se arch\""));
    assert!(make(&[""], d.clone()).contains("multi_turn.tools"));
    let zero = MultiTurnConfig {
        max_turns: 0,
        ..d.clone()
    };
    assert!(make(&["a"], zero).contains("multi_turn.max_turns"));
    let obs = MultiTurnConfig {
        max_obs_length: 0,
        ..d
    };
    assert!(make(&["a"], obs).contains("multi_turn.max_obs_length"));
    let cfg: std::result::Result<MultiTurnConfig, _> = serde_json::from_str(r#"{"max_turn": 2}"#);
    assert!(cfg.unwrap_err().to_string().contains("max_turn"));
}

#[test]
fn gathering_columns_keeps_what_the_cache_computes() {
    // a cache with a hole in the middle gives the same next-token state as its squeezed copy
    let lm = tiny(17);
    let (ids, mask, pos) = prompts();
    let mut holes = KvCache::new(lm.config(), 4, 12, Kind::Float, Device::Cpu);
    let _ = lm
        .model()
        .forward(&ids, &mask, &pos, Some(&mut holes))
        .unwrap();
    let gap = Tensor::zeros([4, 2], (Kind::Int64, Device::Cpu));
    let _ = lm
        .model()
        .forward(
            &Tensor::full([4, 2], 9, (Kind::Int64, Device::Cpu)),
            &Tensor::cat(&[&mask, &gap], 1),
            &Tensor::zeros([4, 2], (Kind::Int64, Device::Cpu)),
            Some(&mut holes),
        )
        .unwrap();
    let next = Tensor::from_slice(&[20i64, 21, 22, 23]).view([4, 1]);
    let next_pos = pos.narrow(1, 5, 1) + 1;
    let full_mask = Tensor::cat(
        &[
            &mask,
            &gap,
            &Tensor::ones([4, 1], (Kind::Int64, Device::Cpu)),
        ],
        1,
    );
    let with_holes = lm
        .model()
        .forward(&next, &full_mask, &next_pos, Some(&mut holes))
        .unwrap();
    let mut squeezed = KvCache::new(lm.config(), 4, 12, Kind::Float, Device::Cpu);
    let _ = lm
        .model()
        .forward(&ids, &mask, &pos, Some(&mut squeezed))
        .unwrap();
    // rows 3 and 1 hold 5 and 4 real tokens: squeeze to 5 columns, row 1 left-padded by one
    let rows = Tensor::from_slice(&[3i64, 1]);
    let columns = mask
        .index_select(0, &rows)
        .argsort_stable(true, 1, false)
        .narrow(1, 1, 5);
    squeezed.gather_columns(&rows, &columns, 6).unwrap();
    assert_eq!(
        (squeezed.len(), squeezed.capacity(), squeezed.batch()),
        (5, 6, 2)
    );
    let m = mask.index_select(0, &rows).gather(1, &columns, false);
    let m = Tensor::cat(&[&m, &Tensor::ones([2, 1], (Kind::Int64, Device::Cpu))], 1);
    let got = lm
        .model()
        .forward(
            &next.index_select(0, &rows),
            &m,
            &next_pos.index_select(0, &rows),
            Some(&mut squeezed),
        )
        .unwrap();
    let err = (got - with_holes.index_select(0, &rows))
        .abs()
        .max()
        .double_value(&[]);
    assert!(err < 1e-5, "{err}");
    let bad = squeezed
        .gather_columns(&rows, &Tensor::zeros([2, 9], (Kind::Int64, Device::Cpu)), 4)
        .unwrap_err();
    assert!(bad.to_string().contains("capacity"), "{bad}");
}

#[test]
fn the_rollout_worker_writes_the_loss_mask_and_the_turn_columns() {
    use crate::roles::{RolloutWorker, ValKwargs, share};
    use rl_core::roles::Rollout;
    use rl_core::{Batch, keys};
    let tool = Arc::new(Lookup::named("t"));
    let mt = MultiTurnConfig {
        max_turns: 1,
        max_obs_length: 2,
    };
    let env = ToolEnv::new(
        vec![
            Box::new(Shared(tool.clone())),
            Box::new(Lookup::named("other")),
        ],
        Arc::new(Codec {
            decode_one: always_call,
        }),
        mt,
    )
    .unwrap();
    let mut worker = RolloutWorker::new(
        share(tiny(18)),
        greedy(8, 2),
        ValKwargs::default(),
        vec![2],
        0,
    )
    .unwrap()
    .with_tools(env)
    .unwrap();
    let (ids, mask, pos) = prompts();
    let mut prompts = Batch::new();
    prompts.insert(keys::INPUT_IDS, ids).unwrap();
    prompts.insert(keys::ATTENTION_MASK, mask).unwrap();
    prompts.insert(keys::POSITION_IDS, pos).unwrap();
    let out = worker.generate(&prompts).unwrap();
    assert_eq!(out.len(), 8);
    // call, 2 observation tokens, the second call closes past max_turns
    let lm = out.get(keys::LOSS_MASK).unwrap();
    assert_eq!(lm.size(), [8, 14]);
    assert_eq!(
        Vec::<i64>::try_from(lm.get(0).narrow(0, 6, 8)).unwrap(),
        [1, 0, 0, 1, 0, 0, 0, 0]
    );
    let policy = keys::policy_mask(&out).unwrap();
    assert_eq!(policy.sum(Kind::Float).double_value(&[]), 16.0);
    assert_eq!(
        out.get(keys::RESPONSE_MASK)
            .unwrap()
            .sum(Kind::Float)
            .double_value(&[]),
        32.0
    );
    let calls = out.column(keys::TOOL_CALLS).unwrap();
    assert_eq!(
        calls[0],
        serde_json::json!({"t": {"calls": 1, "failed": 0}, "other": {"calls": 0, "failed": 0}})
    );
    assert_eq!(out.column(keys::NUM_TURNS).unwrap()[3], 2);
    assert_eq!(out.column(keys::VALID_ACTIONS).unwrap()[3], 1);
    assert_eq!(tool.batches.lock().unwrap().len(), 1);
}

/// The actor's log-probs of a multi-turn batch (one forward over the compacted history) equal
/// the rollout's at every generated token: the layout, positions and masks line up.
#[test]
fn the_actor_recomputes_the_rollout_log_probs_of_generated_tokens() {
    use crate::roles::{ActorConfig, ActorWorker, RolloutWorker, ValKwargs, share};
    use rl_core::roles::{Actor, Rollout};
    use rl_core::{Batch, keys};
    let tool = Arc::new(Lookup::named("t"));
    let mt = MultiTurnConfig {
        max_turns: 3,
        max_obs_length: 5,
    };
    let policy = share(tiny(19));
    let cfg = RolloutConfig {
        n: 2,
        response_length: 40,
        ..RolloutConfig::default()
    };
    let mut worker = RolloutWorker::new(policy.clone(), cfg, ValKwargs::default(), vec![2], 0)
        .unwrap()
        .with_tools(env(&tool, mixed, mt))
        .unwrap();
    let (ids, mask, pos) = prompts();
    let mut prompts = Batch::new();
    prompts.insert(keys::INPUT_IDS, ids).unwrap();
    prompts.insert(keys::ATTENTION_MASK, mask).unwrap();
    prompts.insert(keys::POSITION_IDS, pos).unwrap();
    let out = worker.generate(&prompts).unwrap();
    let mut actor = ActorWorker::new(policy, ActorConfig::default(), 2).unwrap();
    let old = actor.compute_log_prob(&out, false).unwrap();
    let policy_mask = keys::policy_mask(&out).unwrap();
    let observed = (out.get(keys::RESPONSE_MASK).unwrap() - &policy_mask)
        .sum(Kind::Float)
        .double_value(&[]);
    assert!(observed > 0.0, "no observation tokens to skip");
    let diff = ((old.get(keys::OLD_LOG_PROBS).unwrap()
        - out.get(keys::ROLLOUT_LOG_PROBS).unwrap())
        * &policy_mask)
        .abs()
        .max()
        .double_value(&[]);
    assert!(diff < 1e-4, "{diff}");
}
