//! Checkpoints on disk: written whole or not at all (a temp folder, fsync, rename), with the
//! SHA-256 of every file in their `harness.json` and in the store, and the run and store they
//! belong to. A resume takes a checkpoint only after checking all of that ([`pick`]), and when
//! the newest is corrupt it says so and names the previous intact one.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result, bail};
use rl_core::Trainer;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::runtime::Runtime;

use crate::config::{self, ExperimentConfig, TrainerKind};
use crate::store::{CheckpointRow, Store, now};

/// The file that marks a complete checkpoint; written last.
const META: &str = "harness.json";

/// What the harness writes next to the trainer's state in a checkpoint (`harness.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// The run.
    pub run_id: i64,
    /// The step the checkpoint was taken after.
    pub step: u64,
    /// Unix seconds.
    pub created: f64,
    /// The trainer kind.
    pub algorithm: TrainerKind,
    /// The identity of the run store the run is in ([`Store::id`]); absent in checkpoints from
    /// before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_id: Option<String>,
    /// Every other file of the checkpoint (path relative to it, `/`-separated) and its
    /// checksum; empty in checkpoints from before checksums were kept.
    #[serde(default)]
    pub files: BTreeMap<String, FileSum>,
}

/// A file's size and SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    /// Bytes.
    pub bytes: u64,
    /// SHA-256, lower-case hex.
    pub sha256: String,
}

/// Writes a checkpoint of `trainer`: a temp folder → trainer state, resolved config, the
/// checksums and `harness.json` → fsync → rename → record in the store (with the checksums)
/// → prune beyond `trainer.max_ckpt_to_keep`.
pub fn save(
    rt: &Runtime,
    store: &Store,
    run_id: i64,
    run_dir: &Path,
    cfg: &ExperimentConfig,
    trainer: &dyn Trainer,
) -> Result<()> {
    let step = trainer.global_step();
    let ckpts = run_dir.join("checkpoints");
    let final_dir = ckpts.join(format!("global_step_{step}"));
    let tmp = ckpts.join(format!(".tmp-global_step_{step}-{}", std::process::id()));
    let ctx = || format!("writing checkpoint {} of run {run_id}", final_dir.display());
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(ctx)?;
    }
    std::fs::create_dir_all(tmp.join("trainer")).with_context(ctx)?;
    trainer
        .save_checkpoint(&tmp.join("trainer"))
        .with_context(ctx)?;
    std::fs::write(tmp.join("config.json"), config::to_json(cfg)?).with_context(ctx)?;
    std::fs::write(tmp.join("config.toml"), config::to_toml(cfg)?).with_context(ctx)?;
    let files = manifest_of(&tmp).with_context(ctx)?;
    let manifest = serde_json::to_string(&files)?;
    let meta = CheckpointMeta {
        run_id,
        step,
        created: now(),
        algorithm: cfg.trainer.algorithm,
        store_id: Some(store.id().to_string()),
        files,
    };
    // harness.json is written last: its presence marks a complete checkpoint.
    std::fs::write(tmp.join(META), serde_json::to_vec_pretty(&meta)?).with_context(ctx)?;
    fsync_tree(&tmp).with_context(ctx)?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).with_context(ctx)?;
    }
    std::fs::rename(&tmp, &final_dir).with_context(ctx)?;
    fsync_dir(&ckpts).with_context(ctx)?;
    let path = final_dir.display().to_string();
    let keep = cfg.trainer.max_ckpt_to_keep;
    rt.block_on(store.write(move |c| {
        Box::pin(async move {
            sqlx::query(
                "INSERT OR REPLACE INTO checkpoints (run_id, step, path, created, manifest) \
                 VALUES (?, ?, ?, ?, ?)",
            )
            .bind(run_id)
            .bind(step as i64)
            .bind(&path)
            .bind(now())
            .bind(&manifest)
            .execute(&mut *c)
            .await?;
            Ok(0)
        })
    }))
    .with_context(ctx)?;
    if let Some(keep) = keep {
        let all = rt.block_on(store.checkpoints(run_id))?;
        if all.len() as u64 > keep {
            let old: Vec<CheckpointRow> = all[..all.len() - keep as usize].to_vec();
            let steps: Vec<i64> = old.iter().map(|c| c.step).collect();
            rt.block_on(store.write(move |c| {
                Box::pin(async move {
                    for s in steps {
                        sqlx::query("DELETE FROM checkpoints WHERE run_id = ? AND step = ?")
                            .bind(run_id)
                            .bind(s)
                            .execute(&mut *c)
                            .await?;
                    }
                    Ok(0)
                })
            }))?;
            for c in old {
                std::fs::remove_dir_all(&c.path).ok();
            }
        }
    }
    tracing::info!(run = run_id, step, "checkpoint {}", final_dir.display());
    Ok(())
}

/// The checkpoint a resume of run `run_id` (named `spec` on the command line) continues from:
/// the newest recorded one, or the one at `from_step`, after [`verify`]ing it. A corrupt one is
/// refused, naming the fault and the newest earlier checkpoint that is intact.
pub fn pick(
    ckpts: &[CheckpointRow],
    run_id: i64,
    store_id: &str,
    spec: &str,
    from_step: Option<u64>,
) -> Result<CheckpointRow> {
    let Some(chosen) = ckpts
        .iter()
        .rev()
        .find(|c| from_step.is_none_or(|s| c.step as u64 == s))
    else {
        match from_step {
            Some(s) => bail!(
                "run {run_id} has no checkpoint at step {s} (recorded: {:?})",
                ckpts.iter().map(|c| c.step).collect::<Vec<_>>()
            ),
            None => bail!("run {run_id} has no checkpoint to resume from"),
        }
    };
    let why = match verify(chosen, run_id, store_id) {
        Ok(_) => return Ok(chosen.clone()),
        Err(why) => why,
    };
    tracing::warn!(
        run = run_id,
        step = chosen.step,
        "checkpoint refused: {why:#}"
    );
    let earlier = ckpts
        .iter()
        .rev()
        .filter(|c| c.step < chosen.step)
        .find(|c| verify(c, run_id, store_id).is_ok());
    match earlier {
        Some(prev) => bail!(
            "checkpoint {} of run {run_id} is corrupt: {why:#}; `harness resume {spec} \
             --from-step {}` uses the previous one",
            chosen.step,
            prev.step
        ),
        None => bail!(
            "checkpoint {} of run {run_id} is corrupt: {why:#}; no earlier checkpoint of it is \
             intact, so it can only be started again",
            chosen.step
        ),
    }
}

/// Checks that recorded checkpoint `ckpt` is whole and is run `run_id`'s of store `store_id`:
/// its `harness.json` names them, its checksums are the ones the store recorded, and every file
/// has its recorded size and SHA-256. A checkpoint from before checksums were kept is taken on
/// its `harness.json` alone, with a warning.
pub fn verify(ckpt: &CheckpointRow, run_id: i64, store_id: &str) -> Result<CheckpointMeta> {
    let dir = Path::new(&ckpt.path);
    let meta_path = dir.join(META);
    let bytes = std::fs::read(&meta_path).with_context(|| {
        format!(
            "{} is missing or unreadable (the folder was moved, deleted or cut short)",
            meta_path.display()
        )
    })?;
    let meta: CheckpointMeta = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not valid", meta_path.display()))?;
    if meta.run_id != run_id {
        bail!(
            "{} belongs to run {}, not run {run_id} (another run store's run wrote into this \
             folder?)",
            dir.display(),
            meta.run_id
        );
    }
    if let Some(theirs) = &meta.store_id
        && theirs != store_id
    {
        bail!(
            "{} belongs to run {} of another run store (store id {theirs}, this one {store_id})",
            dir.display(),
            meta.run_id
        );
    }
    if meta.step != ckpt.step as u64 {
        bail!(
            "{} holds step {} but is recorded as step {}",
            meta_path.display(),
            meta.step,
            ckpt.step
        );
    }
    if let Some(recorded) = &ckpt.manifest {
        let recorded: BTreeMap<String, FileSum> = serde_json::from_str(recorded)
            .with_context(|| format!("the checksums the store recorded for {}", dir.display()))?;
        if recorded != meta.files {
            bail!(
                "the checksums in {} differ from the ones the store recorded",
                meta_path.display()
            );
        }
    }
    if meta.files.is_empty() {
        tracing::warn!(
            "{} has no checksums (written before they were kept); taken as it is",
            dir.display()
        );
    }
    for (name, want) in &meta.files {
        let path = dir.join(name);
        let got = sum_file(&path).with_context(|| format!("{name}: cannot be read"))?;
        if got.bytes != want.bytes {
            bail!(
                "{name}: {} bytes, {} recorded (cut short or overwritten)",
                got.bytes,
                want.bytes
            );
        }
        if got.sha256 != want.sha256 {
            bail!(
                "{name}: checksum mismatch (sha256 {}…, {}… recorded)",
                &got.sha256[..12],
                &want.sha256[..want.sha256.len().min(12)]
            );
        }
    }
    Ok(meta)
}

/// Reads `harness.json` of checkpoint folder `dir` (no checks).
pub fn read_meta(dir: &Path) -> Result<CheckpointMeta> {
    let path = dir.join(META);
    serde_json::from_slice(
        &std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("parsing {}", path.display()))
}

/// Every file under `dir` but `harness.json`, by `/`-separated relative path, with its sum.
fn manifest_of(dir: &Path) -> std::io::Result<BTreeMap<String, FileSum>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let path = e.path();
            if e.file_type()?.is_dir() {
                todo.push(path);
                continue;
            }
            let rel = path
                .strip_prefix(dir)
                .map_err(std::io::Error::other)?
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            if rel != META {
                out.insert(rel, sum_file(&path)?);
            }
        }
    }
    Ok(out)
}

/// The size and SHA-256 of a file.
fn sum_file(path: &Path) -> std::io::Result<FileSum> {
    let mut f = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    let sha256 = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(FileSum { bytes, sha256 })
}

/// Removes the `.tmp-*` folders a process killed while saving a checkpoint left in `<run
/// dir>/checkpoints` (never recorded in the store, so never resumed from; this only tidies).
pub(crate) fn remove_partial(run_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(run_dir.join("checkpoints")) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn fsync_tree(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            fsync_tree(&path)?;
        } else {
            std::fs::File::open(&path)?.sync_all()?;
        }
    }
    fsync_dir(dir)
}

fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}
