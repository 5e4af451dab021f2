//! The roles on a device: the Llama/Qwen2 model family in tch, Hugging Face loading and saving,
//! GGUF import, and the batched rollout engine.
//!
//! - [`Config`], [`Model`], [`KvCache`]: the decoder stack (`LlamaModel` / `Qwen2Model`).
//! - [`CausalLm`], [`ValueModel`], [`RewardModel`]: the heads, each with `from_pretrained` /
//!   `save_pretrained` over a Hugging Face directory.
//! - [`lora`]: PEFT's LoRA adapters on any of the heads ([`LoraConfig`]), saved and loaded in
//!   PEFT's format.
//! - [`gguf::import`]: a llama.cpp GGUF file to a Hugging Face directory.
//! - [`generate`] with [`RolloutConfig`]: the batched, KV-cached rollout engine.
//! - [`generate_multi_turn`] with a [`ToolEnv`]: multi-turn rollouts that call tools between
//!   turns, keeping the KV cache.
//! - [`ParamShards`]: ZeRO stage 3, the parameters sharded over data-parallel ranks and
//!   gathered a layer at a time.
//! - [`roles`]: actor, rollout (sharing the actor's weights), reference and critic workers.
//! - [`seeded`], [`hold_generator`]: seeded initialisations that other threads cannot disturb.

mod attention;
pub mod engine;
mod error;
mod ffi;
mod fsdp;
mod fused;
pub mod fused_head;
pub mod gemm;
pub mod gguf;
mod heads;
pub mod heap;
mod hf;
pub mod lora;
mod model;
mod multiturn;
pub mod remote;
pub mod roles;
mod rollout;
mod seed;
mod segments;

pub use error::{Error, Result};
pub use fsdp::{HeldAll, ParamShards};
pub use heads::{CONFIG_JSON, CausalLm, RewardModel, ValueModel};
pub use lora::{LoraConfig, TargetModules};
pub use model::{Config, Family, KvCache, LinearShape, Model, TokenIds};
pub use multiturn::{
    ANSWER_TAG, MultiTurnConfig, MultiTurnOutput, StopReason, TextCodec, ToolEnv, TurnStats,
    generate_multi_turn, token_ids_u32,
};
pub use rollout::{GenerateOptions, Progress, RolloutConfig, RolloutOutput, generate};
pub use seed::{GeneratorGuard, hold_generator, seeded};
