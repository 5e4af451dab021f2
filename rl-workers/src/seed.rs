//! Torch's CPU generator is one per process, and every fresh model draws its initial weights
//! from it (a model loaded from disk too: it is initialised, then overwritten). Two threads that
//! seed it and build models at the same time interleave their draws, so a seeded model would
//! depend on the other thread's timing. Every construction in this crate draws under one
//! process-wide lock, and [`seeded`] holds that lock from the seeding to the end of its
//! closure: a seeded initialisation is then the same however threads are scheduled. The lock is
//! re-entrant on the thread that holds it, so a closure may build any number of models.
//!
//! A model about to be overwritten (loaded from a checkpoint, copied from another model) draws
//! nothing: its variables are built inside [`to_be_filled`], which allocates them in their
//! final dtype, uninitialised. Drawing 7 billion normal numbers in float32 only to overwrite
//! them would cost a minute and twice the memory of a bfloat16 model, and would move the
//! generator's stream for whatever is initialised after (a fresh value head).

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tch::nn::{Init, Path as VarPath};
use tch::{Kind, Tensor};

static GENERATOR: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread holds [`GENERATOR`] (a [`GeneratorGuard`] that locked it is alive).
    static HELD: Cell<bool> = const { Cell::new(false) };
}

/// Holds torch's global generator for this thread until dropped (see the module docs); a
/// nested hold on the same thread is a no-op.
#[derive(Debug)]
#[must_use = "the generator is held only while the guard lives"]
pub struct GeneratorGuard {
    guard: Option<MutexGuard<'static, ()>>,
}

impl Drop for GeneratorGuard {
    fn drop(&mut self) {
        if self.guard.take().is_some() {
            HELD.with(|h| h.set(false));
        }
    }
}

/// Holds torch's global generator: no other thread seeds it or builds a model until the guard
/// is dropped.
pub fn hold_generator() -> GeneratorGuard {
    if HELD.with(Cell::get) {
        return GeneratorGuard { guard: None };
    }
    let guard = GENERATOR.lock().unwrap_or_else(PoisonError::into_inner);
    HELD.with(|h| h.set(true));
    GeneratorGuard { guard: Some(guard) }
}

thread_local! {
    /// Set while this thread builds variables that will be overwritten before use: their
    /// dtype ([`to_be_filled`]).
    static FILLED_LATER: Cell<Option<Kind>> = const { Cell::new(None) };
}

/// Runs `f` with every variable it builds through [`var`] allocated in `kind`, uninitialised,
/// drawing nothing: for weights the caller overwrites in full before anything reads them (a
/// checkpoint whose loading fails on any missing tensor, a snapshot of every variable).
pub(crate) fn to_be_filled<T>(kind: Kind, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<Kind>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FILLED_LATER.with(|l| l.set(self.0));
        }
    }
    let _restore = Restore(FILLED_LATER.with(|l| l.replace(Some(kind))));
    f()
}

/// A trainable variable `name` under `p`, initialised by `init` (from torch's global generator)
/// unless built inside [`to_be_filled`].
pub(crate) fn var(p: &VarPath, name: &str, dims: &[i64], init: Init) -> Tensor {
    match FILLED_LATER.with(Cell::get) {
        Some(kind) => p.add(name, Tensor::empty(dims, (kind, p.device())), true),
        None => p.var(name, dims, init),
    }
}

/// Runs `f` with torch's global generator seeded with `seed` and held (see the module docs):
/// the models `f` builds start from the same weights on every run, whatever other threads do.
pub fn seeded<T>(seed: i64, f: impl FnOnce() -> T) -> T {
    let _held = hold_generator();
    tch::manual_seed(seed);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CausalLm, Config};
    use tch::{Device, Kind};

    fn weights(lm: &CausalLm) -> Vec<tch::Tensor> {
        let mut vars: Vec<_> = lm.var_store().variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars.into_iter().map(|(_, t)| t).collect()
    }

    /// A seeded model equals itself while other threads keep seeding and building models.
    #[test]
    fn a_seeded_init_is_the_same_under_concurrent_seeding_and_builds() {
        let cfg = Config::tiny();
        let want = weights(&seeded(3, || CausalLm::new(&cfg, Device::Cpu, Kind::Float)).unwrap());
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for t in 0..2 {
                let (cfg, stop) = (&cfg, &stop);
                s.spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        seeded(100 + t, || CausalLm::new(cfg, Device::Cpu, Kind::Float)).unwrap();
                        CausalLm::new(cfg, Device::Cpu, Kind::Float).unwrap();
                    }
                });
            }
            let changed = (0..20).any(|_| {
                let got = seeded(3, || CausalLm::new(&cfg, Device::Cpu, Kind::Float)).unwrap();
                weights(&got).iter().zip(&want).any(|(a, b)| !a.equal(b))
            });
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            assert!(!changed, "a seeded init changed under concurrent builds");
        });
    }

    /// Loading a model draws nothing from torch's generator and builds it in its dtype; a
    /// critic loaded from a language model's checkpoint draws its fresh value head alone; a
    /// replica (adapters included) draws nothing either.
    #[test]
    fn loading_or_copying_a_model_draws_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config::tiny();
        let saved = seeded(3, || CausalLm::new(&cfg, Device::Cpu, Kind::Float)).unwrap();
        saved.save_pretrained(dir.path()).unwrap();
        let next_draw = |f: &mut dyn FnMut()| {
            seeded(11, || {
                f();
                tch::Tensor::randn([8], (Kind::Float, Device::Cpu))
            })
        };
        let untouched = next_draw(&mut || {});
        for kind in [Kind::Float, Kind::BFloat16] {
            let mut got = None;
            let after = next_draw(&mut || {
                got = Some(CausalLm::from_pretrained(dir.path(), Device::Cpu, kind).unwrap());
            });
            assert!(after.equal(&untouched), "loading in {kind:?} drew numbers");
            for (w, want) in weights(got.as_ref().unwrap()).iter().zip(weights(&saved)) {
                assert_eq!(w.kind(), kind);
                assert!(w.equal(&want.to_kind(kind)));
                assert!(w.requires_grad());
            }
        }

        let critic = seeded(11, || {
            crate::ValueModel::from_pretrained(dir.path(), Device::Cpu, Kind::Float)
        })
        .unwrap();
        assert!(critic.fresh_head());
        let want = seeded(11, || {
            tch::Tensor::randn([1, cfg.hidden_size], (Kind::Float, Device::Cpu))
                * cfg.initializer_range
        });
        let vars = critic.var_store().variables();
        assert!(
            vars["score.weight"].equal(&want),
            "the head is not the first draw"
        );
        assert!(vars["score.bias"].equal(&tch::Tensor::zeros([1], (Kind::Float, Device::Cpu))));

        let mut lora = seeded(3, || CausalLm::new(&cfg, Device::Cpu, Kind::Float)).unwrap();
        lora.add_lora(&crate::LoraConfig {
            rank: 2,
            alpha: 4.0,
            target_modules: Default::default(),
            exclude_modules: Vec::new(),
            dropout: 0.0,
            use_rslora: false,
        })
        .unwrap();
        let mut copy = None;
        let after = next_draw(&mut || copy = Some(lora.replica().unwrap()));
        assert!(after.equal(&untouched), "a replica drew numbers");
        let copy = copy.unwrap();
        for (a, b) in weights(&copy).iter().zip(weights(&lora)) {
            assert!(a.equal(&b));
        }
        assert_eq!(weights(&copy).len(), weights(&lora).len());
    }

    #[test]
    fn the_hold_is_reentrant_on_its_thread() {
        let outer = hold_generator();
        let inner = hold_generator();
        drop(inner);
        assert!(
            HELD.with(Cell::get),
            "dropping a nested hold released the outer one"
        );
        drop(outer);
        assert!(!HELD.with(Cell::get));
    }
}
