//! Datasets in verl's parquet schema, tokenisation and chat templates, collation into a
//! `Batch`, a resumable loader, synthetic task generators, and rule-based rewards.
//!
//! - [`Tokenizer`] / [`ChatTemplate`]: Hugging Face `tokenizer.json` + `tokenizer_config.json`,
//!   templates rendered as transformers' `apply_chat_template` renders them.
//! - [`RlDataset`] reads verl-schema parquet (verl's `RLHFDataset`); [`PromptEncoder`] renders
//!   and tokenises under `truncation`; [`DataLoader`] batches with a seeded per-epoch shuffle
//!   and a [`LoaderState`] that resumes exactly; [`collate_left_padded`] pads.
//!   [`DataLoader::train`] / [`DataLoader::val`] build both from a [`DataConfig`]. Batches are
//!   padded with the pad token, or the eos token when there is none (as verl does).
//! - [`SftDataset`] (single- and multi-turn, `loss_mask` on assistant tokens) and
//!   [`PreferenceDataset`] (prompt, chosen, rejected) for SFT and DPO-family trainers.
//! - [`reward`]: rule rewards chosen by `data_source` as verl's `default_compute_score` does.
//! - [`tasks`]: the GSM8K preprocessor and seeded synthetic task generators.

mod config;
mod dataset;
mod error;
mod loader;
mod parquet_io;
pub mod reward;
mod sft;
pub mod tasks;
pub mod tokenizer;

pub use config::{DataConfig, MultiturnConfig, PreferenceDataConfig, SftDataConfig, Truncation};
pub use dataset::{
    EncodedPrompt, PromptEncoder, ReadOptions, RlDataset, RlRow, RowSource, RowStream, stream_rows,
};
pub use error::{Error, Result};
pub use loader::Sampler;
pub use loader::{
    DataLoader, LoaderOptions, LoaderState, PromptBatch, collate_left_padded, epoch_order,
};
pub use parquet_io::{
    PreferenceRecord, RlRecord, write_batches, write_preference_parquet, write_rl_parquet,
};
pub use sft::{
    PreferenceBatch, PreferenceDataset, PreferenceExample, SftBatch, SftDataset, SftExample,
    collate_right_padded, observation_segments, tokenize_conversation, tokenize_prompt_response,
    tokenize_prompt_trace,
};
pub use tokenizer::{ChatTemplate, Message, SpecialTokens, TemplateValue, Tokenizer};

#[cfg(test)]
pub(crate) mod test_support {
    //! Fixture paths and tokenizers shared by the unit tests.
    use std::path::{Path, PathBuf};

    /// `rl-data/tests/fixtures/<rel>`.
    pub(crate) fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(rel)
    }

    /// A fixture tokenizer: `smollm2`, `qwen2_5`, `llama3`, ... (see tests/fixtures/tokenizer).
    pub(crate) fn tokenizer(case: &str) -> crate::Tokenizer {
        let cfg = fixture(&format!("tokenizer/cases/{case}/tokenizer_config.json"));
        let exp: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(&format!("tokenizer/cases/{case}/expected.json")))
                .unwrap(),
        )
        .unwrap();
        let tj = fixture(&format!(
            "tokenizer/tokenizers/{}",
            exp["tokenizer"].as_str().unwrap()
        ));
        crate::Tokenizer::from_files(tj, Some(&cfg)).unwrap()
    }
}

#[cfg(test)]
mod thread_safety {
    //! The harness shares these across threads.
    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn public_types_are_send_and_sync() {
        send_sync::<crate::Tokenizer>();
        send_sync::<crate::RlDataset>();
        send_sync::<crate::reward::RewardRegistry>();
        send_sync::<crate::LoaderState>();
        send_sync::<crate::SftDataset>();
    }
}
