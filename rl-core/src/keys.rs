//! verl's batch keys, verbatim, each documented once with its shape, dtype, writer and reader.
//!
//! Dimension names: `batch` rows, `prompt_len` (left-padded prompt), `response_len` (right-padded
//! response), `seq_len = prompt_len + response_len`. Masks use 1 for a real token.

/// One entry of the key table: what a key holds and who writes and reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySpec {
    /// The key string, verl's name.
    pub name: &'static str,
    /// Whether the value is a tensor (`true`) or a per-row non-tensor column (`false`).
    pub tensor: bool,
    /// Shape in the crate's dimension vocabulary (`[batch, response_len]`).
    pub shape: &'static str,
    /// Element type (`i64`, `f32`, `string`, `json`).
    pub dtype: &'static str,
    /// The step that writes it.
    pub writer: &'static str,
    /// The steps that read it.
    pub reader: &'static str,
}

macro_rules! keys {
    ($( $(#[$doc:meta])* $konst:ident = $name:literal, $kind:ident, $shape:literal, $dtype:literal,
        writer: $writer:literal, reader: $reader:literal; )*) => {
        $(
            $(#[$doc])*
            #[doc = ""]
            #[doc = concat!("- shape: `", $shape, "`, dtype: `", $dtype, "`")]
            #[doc = concat!("- written by: ", $writer)]
            #[doc = concat!("- read by: ", $reader)]
            pub const $konst: &str = $name;
        )*
        /// Every documented key, in the order of this module.
        pub const ALL: &[KeySpec] = &[
            $( KeySpec { name: $name, tensor: keys!(@tensor $kind), shape: $shape, dtype: $dtype,
                         writer: $writer, reader: $reader }, )*
        ];
    };
    (@tensor tensor) => { true };
    (@tensor column) => { false };
}

keys! {
    /// Token ids of prompt and response, prompt left-padded.
    INPUT_IDS = "input_ids", tensor, "[batch, seq_len]", "i64",
        writer: "rl-data collation (prompt only), rollout (prompt + response)",
        reader: "rollout, actor, reference, critic, reward model";
    /// 1 for real tokens, 0 for padding.
    ATTENTION_MASK = "attention_mask", tensor, "[batch, seq_len]", "i64",
        writer: "rl-data collation, rollout", reader: "every forward pass";
    /// Positions counted over real tokens only (0 at the first real token, left padding clipped to 0).
    POSITION_IDS = "position_ids", tensor, "[batch, seq_len]", "i64",
        writer: "rl-data collation, rollout", reader: "every forward pass";
    /// The left-padded prompt part of `input_ids`.
    PROMPTS = "prompts", tensor, "[batch, prompt_len]", "i64",
        writer: "rollout", reader: "reward (decoding), metrics";
    /// The generated tokens, right-padded with the pad id.
    RESPONSES = "responses", tensor, "[batch, response_len]", "i64",
        writer: "rollout", reader: "actor, reference, critic, reward";
    /// 1.0 on real response tokens (including the stopping EOS and, in multi-turn rollouts, the
    /// tool observations), 0.0 on padding: lengths, the reward's last token and decoding read
    /// it. Losses and advantages read it restricted by [`LOSS_MASK`] (see [`policy_mask`]).
    RESPONSE_MASK = "response_mask", tensor, "[batch, response_len]", "f32",
        writer: "rollout", reader: "reward placement, decoding, length metrics; losses and advantages through `policy_mask`";
    /// Log-probs of the response tokens under the policy that will be updated, before the update.
    OLD_LOG_PROBS = "old_log_probs", tensor, "[batch, response_len]", "f32",
        writer: "actor.compute_log_prob", reader: "policy loss (importance ratio)";
    /// Log-probs of the response tokens under the frozen reference policy.
    REF_LOG_PROB = "ref_log_prob", tensor, "[batch, response_len]", "f32",
        writer: "reference.compute_ref_log_prob", reader: "KL in reward, KL loss";
    /// Log-probs of the sampled tokens under the sampling distribution the rollout actually used.
    ROLLOUT_LOG_PROBS = "rollout_log_probs", tensor, "[batch, response_len]", "f32",
        writer: "rollout", reader: "rollout importance-sampling correction, metrics";
    /// Truncated importance weights `π_train / π_rollout` of rollout correction (verl's
    /// `algorithm.rollout_correction.rollout_is`), zero at masked positions.
    ROLLOUT_IS_WEIGHTS = "rollout_is_weights", tensor, "[batch, response_len]", "f32",
        writer: "rl-algos rollout_corr (trainer, decoupled mode)", reader: "policy loss, optimal token baseline";
    /// `Σπ²` over the vocabulary at each response position (verl's `sum_pi_squared`).
    SUM_PI_SQUARED = "sum_pi_squared", tensor, "[batch, response_len]", "f32",
        writer: "actor.compute_log_prob (when asked)", reader: "optimal token baseline";
    /// Per-token entropy of the policy.
    ENTROPYS = "entropys", tensor, "[batch, response_len]", "f32",
        writer: "actor.compute_log_prob (when asked)", reader: "metrics, Clip-Cov / KL-Cov";
    /// Critic value estimates per response token.
    VALUES = "values", tensor, "[batch, response_len]", "f32",
        writer: "critic.compute_values", reader: "GAE, value loss";
    /// Scores from reward functions / reward model, usually on the last response token.
    TOKEN_LEVEL_SCORES = "token_level_scores", tensor, "[batch, response_len]", "f32",
        writer: "reward", reader: "KL-in-reward, advantage estimators, metrics";
    /// Scores after the KL-in-reward penalty (equal to the scores when KL is not in the reward).
    TOKEN_LEVEL_REWARDS = "token_level_rewards", tensor, "[batch, response_len]", "f32",
        writer: "rl-algos kl::apply_kl_penalty", reader: "advantage estimators";
    /// Per-token advantages, zero at masked positions.
    ADVANTAGES = "advantages", tensor, "[batch, response_len]", "f32",
        writer: "rl-algos advantage estimators", reader: "policy loss";
    /// Per-token returns (value targets), zero at masked positions.
    RETURNS = "returns", tensor, "[batch, response_len]", "f32",
        writer: "rl-algos advantage estimators", reader: "value loss";
    /// Reward-model scores (before combining with rule scores).
    RM_SCORES = "rm_scores", tensor, "[batch, response_len]", "f32",
        writer: "reward model worker", reader: "reward combination";
    /// 1 on tokens that contribute to the loss (SFT: assistant tokens; multi-turn rollout: the
    /// tokens the model generated, 0 on the prompt, tool observations and padding). verl's
    /// multi-turn `response_mask`; here `response_mask` keeps covering the whole response and
    /// this key, when present, restricts it for every loss ([`policy_mask`]).
    LOSS_MASK = "loss_mask", tensor, "[batch, seq_len]", "i64",
        writer: "rl-data SFT collation, multi-turn rollout",
        reader: "SFT, policy, entropy, KL and value losses, KL-in-reward, advantages";
    /// Model turns of each multi-turn response (verl's `__num_turns__`).
    NUM_TURNS = "__num_turns__", column, "[batch]", "i64",
        writer: "multi-turn rollout", reader: "env/number_of_turns";
    /// Tool calls of each multi-turn response: `{"<tool>": {"calls": n, "failed": m}}`.
    TOOL_CALLS = "tool_calls", column, "[batch]", "json",
        writer: "multi-turn rollout", reader: "env/<tool>_calls, env/tool_errors";
    /// Turns of each multi-turn response that ended in a valid action (a call whose
    /// observation is valid, or an answer).
    VALID_ACTIONS = "valid_actions", column, "[batch]", "i64",
        writer: "multi-turn rollout", reader: "env/valid_action_ratio";
    /// Group id shared by the `n` samples of one prompt.
    UID = "uid", column, "[batch]", "string",
        writer: "rl-data loader (deterministic from seed, epoch and index)", reader: "GRPO / RLOO grouping";
    /// Which dataset a row comes from; selects the rule reward.
    DATA_SOURCE = "data_source", column, "[batch]", "string",
        writer: "rl-data loader", reader: "reward dispatch, per-source validation metrics";
    /// The reference answer for rule rewards (verl's `reward_model.ground_truth`).
    GROUND_TRUTH = "ground_truth", column, "[batch]", "json",
        writer: "rl-data loader", reader: "rule rewards";
    /// Free-form per-row information carried through unchanged.
    EXTRA_INFO = "extra_info", column, "[batch]", "json",
        writer: "rl-data loader", reader: "reward functions, logging";
    /// The task family (verl's `ability`).
    ABILITY = "ability", column, "[batch]", "string",
        writer: "rl-data loader", reader: "logging";
}

/// The mask every loss and advantage reads, `[batch, response_len]` f32: [`RESPONSE_MASK`],
/// times the last `response_len` columns of [`LOSS_MASK`] when the batch has one (multi-turn
/// rollouts: zero on tool observations).
///
/// # Shapes
/// - `response_mask`: `[batch, response_len]` float
/// - `loss_mask` (optional): `[batch, seq_len]` with `seq_len >= response_len`
/// - returns `[batch, response_len]` f32
pub fn policy_mask(batch: &crate::Batch) -> crate::Result<tch::Tensor> {
    let mask = batch.get(RESPONSE_MASK)?;
    let (rows, response_len) = crate::shape::expect_2d(RESPONSE_MASK, mask)?;
    let mask = mask.to_kind(tch::Kind::Float);
    if !batch.contains(LOSS_MASK) {
        return Ok(mask);
    }
    let loss = batch.get(LOSS_MASK)?;
    let (loss_rows, seq_len) = crate::shape::expect_2d(LOSS_MASK, loss)?;
    if loss_rows != rows || seq_len < response_len {
        return Err(crate::Error::InvalidArgument {
            name: LOSS_MASK,
            reason: format!(
                "has shape [{loss_rows}, {seq_len}], expected [{rows}, seq_len] with seq_len >= \
                 response_len {response_len}"
            ),
        });
    }
    let tail = loss
        .narrow(1, seq_len - response_len, response_len)
        .to_kind(tch::Kind::Float)
        .to_device(mask.device());
    Ok(mask * tail)
}

/// Looks up a key's documentation.
pub fn spec(name: &str) -> Option<&'static KeySpec> {
    ALL.iter().find(|k| k.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_mask_is_the_response_mask_restricted_by_the_loss_mask() {
        use tch::{Kind, Tensor};
        let mut b = crate::Batch::new();
        let rm = Tensor::from_slice(&[1f32, 1., 1., 0., 1., 1., 0., 0.]).view([2, 4]);
        b.insert(RESPONSE_MASK, rm.shallow_clone()).unwrap();
        assert!(policy_mask(&b).unwrap().equal(&rm));
        // two prompt columns, then generated, observation, generated, padding
        let lm = Tensor::from_slice(&[0i64, 0, 1, 0, 1, 0, 0, 1, 1, 1, 0, 0]).view([2, 6]);
        b.insert(LOSS_MASK, lm).unwrap();
        let want = Tensor::from_slice(&[1f32, 0., 1., 0., 1., 1., 0., 0.]).view([2, 4]);
        assert!(policy_mask(&b).unwrap().equal(&want));
        assert_eq!(policy_mask(&b).unwrap().kind(), Kind::Float);
        let mut short = crate::Batch::new();
        short.insert(RESPONSE_MASK, rm).unwrap();
        short
            .insert(
                LOSS_MASK,
                Tensor::ones([2, 3], (Kind::Int64, tch::Device::Cpu)),
            )
            .unwrap();
        let err = policy_mask(&short).unwrap_err().to_string();
        assert!(
            err.contains("loss_mask") && err.contains("response_len 4"),
            "{err}"
        );
    }

    #[test]
    fn keys_are_unique_and_looked_up() {
        let mut names: Vec<&str> = ALL.iter().map(|k| k.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        assert_eq!(spec(RESPONSE_MASK).unwrap().dtype, "f32");
        assert!(!spec(UID).unwrap().tensor);
        assert!(spec("no_such_key").is_none());
    }

    /// ARCHITECTURE.md's Batch contract table must list every key, so the doc cannot drift.
    #[test]
    fn architecture_md_lists_every_key() {
        let doc = include_str!("../../ARCHITECTURE.md");
        for k in ALL {
            assert!(
                doc.contains(&format!("`{}`", k.name)),
                "ARCHITECTURE.md lacks `{}`",
                k.name
            );
        }
    }
}
