//! Torch's CPU generator is one per process, and every fresh model draws its initial weights
//! from it (a model loaded from disk too: it is initialised, then overwritten). Two threads that
//! seed it and build models at the same time interleave their draws, so a seeded model would
//! depend on the other thread's timing. Every construction in this crate draws under one
//! process-wide lock, and [`seeded`] holds that lock from the seeding to the end of its
//! closure: a seeded initialisation is then the same however threads are scheduled. The lock is
//! re-entrant on the thread that holds it, so a closure may build any number of models.

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard, PoisonError};

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
