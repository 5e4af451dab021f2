//! What a run reports to or is served by outside the harness: the MLflow tracker
//! ([`tracker`], fed from the store's outbox), TensorBoard event files ([`tensorboard`]), and
//! the BM25 retriever behind `harness retriever` and `harness data search-*` (Search-R1's search
//! tool). Each talks to one outside system; they use `config` and `store`, never `run`.

pub(crate) mod retriever;
pub mod tensorboard;
pub mod tracker;
