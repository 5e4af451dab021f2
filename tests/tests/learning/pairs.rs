//! Synthetic preference pairs of the tiny addition task, shared by the preference and
//! reward-model tests: the right answer (`extra_info.answer`) against a wrong one, in the
//! rollout layout, and a fixed list of batches served in a cycle.

use rl_algos::trainer::BatchSource;
use rl_core::Batch;
use rl_data::{RlDataset, RlRow, Tokenizer};
use rl_e2e::{AnyResult, rollout_layout};
use serde_json::Value;

/// `extra_info.answer` of a row: the sum as written in the SFT target (zero-padded on the
/// carry-free task).
pub(crate) fn answer_of(row: &RlRow) -> AnyResult<String> {
    Ok(row
        .extra_info
        .get("answer")
        .and_then(Value::as_str)
        .ok_or("row lacks extra_info.answer")?
        .to_owned())
}

/// Pairs of `dataset`'s rows for the pair indices `idx`, interleaved chosen-first in the
/// rollout layout: pair `k` is row `k % rows` with the right answer chosen and
/// `wrong_answer(answer, k)` rejected, so an index past `rows` reuses a row with another wrong
/// answer.
pub(crate) fn pair_batch(
    dataset: &RlDataset,
    rows: usize,
    tok: &Tokenizer,
    idx: &[usize],
    wrong_answer: impl Fn(&str, usize) -> AnyResult<String>,
) -> AnyResult<Batch> {
    let (mut prompts, mut responses) = (Vec::new(), Vec::new());
    for &k in idx {
        let row = dataset.row(k % rows)?;
        let answer = answer_of(&row)?;
        let wrong = wrong_answer(&answer, k)?;
        for resp in [answer.as_str(), wrong.as_str()] {
            let ex = rl_data::tokenize_prompt_response(tok, &row.prompt, resp)?;
            let split = ex.loss_mask.iter().position(|&m| m == 1).unwrap_or(0);
            prompts.push(ex.input_ids[..split].to_vec());
            responses.push(ex.input_ids[split..].to_vec());
        }
    }
    rollout_layout(&prompts, &responses, tok.pad_id_or_eos()?)
}

/// Fixed batches, cycled; the state is the cursor.
pub(crate) struct Cycle {
    pub(crate) batches: Vec<Batch>,
    pub(crate) cursor: usize,
}

impl BatchSource for Cycle {
    fn next_batch(&mut self) -> rl_core::Result<Batch> {
        let b = self.batches[self.cursor % self.batches.len()].shallow_clone();
        self.cursor += 1;
        Ok(b)
    }
    fn state(&self) -> Value {
        self.cursor.into()
    }
    fn load_state(&mut self, state: &Value) -> rl_core::Result<()> {
        self.cursor = state
            .as_u64()
            .ok_or("cursor is not a number")
            .map_err(|e| rl_core::Error::Role {
                role: "data",
                source: e.into(),
            })? as usize;
        Ok(())
    }
}
