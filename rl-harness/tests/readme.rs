//! The README cannot rot: its first command's script (`scripts/quickstart`, in the mode that
//! skips setup and build) and every block marked `<!-- runnable -->` run here, in a scratch
//! folder laid out like the repository (`target/release/harness` is this build's binary),
//! with the step counts shrunk through `RL_` variables.

mod common;

use std::path::Path;
use std::process::Command;

use common::{Env, repo_root};

/// The `sh` blocks that follow a `<!-- runnable -->` line.
fn runnable_blocks(readme: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        if line.trim() != "<!-- runnable -->" {
            continue;
        }
        assert_eq!(
            lines.next().map(str::trim),
            Some("```sh"),
            "a runnable mark must precede ```sh"
        );
        let body: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
        blocks.push(body.join("\n"));
    }
    blocks
}

fn run(env: &Env, script: &str, vars: &[(&str, &str)]) -> String {
    let mut cmd = Command::new("bash");
    cmd.args(["-e", "-o", "pipefail", "-c", script])
        .current_dir(env.path())
        .env("RUST_LOG", "warn")
        .env_remove("RL_TRAINER__DB");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "README block failed:\n{script}\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_quickstart_and_every_runnable_readme_block_work() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.contains("scripts/quickstart") && readme.contains("scripts/test"),
        "the README's two commands"
    );
    let blocks = runnable_blocks(&readme);
    assert!(blocks.len() >= 4, "{} runnable blocks", blocks.len());

    let env = Env::new();
    std::fs::create_dir_all(env.path().join("target/release")).unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_harness"));
    std::os::unix::fs::symlink(bin, env.path().join("target/release/harness")).unwrap();
    for dir in ["experiments", "scripts"] {
        std::os::unix::fs::symlink(root.join(dir), env.path().join(dir)).unwrap();
    }
    // The whole quickstart path, 2 steps of SFT and 2 of GRPO.
    let out = run(
        &env,
        "scripts/quickstart",
        &[
            ("QUICKSTART_HARNESS", bin.to_str().unwrap()),
            ("RL_TRAINER__TOTAL_TRAINING_STEPS", "2"),
        ],
    );
    assert!(out.contains("val/test_score/arithmetic:"), "{out}");
    assert!(env.path().join("runs/quickstart.svg").is_file());
    assert!(
        env.path()
            .join("models/tiny-llama-sft/model.safetensors")
            .is_file()
    );

    let shrink = [
        ("RL_TRAINER__TOTAL_TRAINING_STEPS", "2"),
        ("RL_TRAINER__TEST_FREQ", "2"),
        ("RL_TRAINER__SAVE_FREQ", "1"),
        // 2 SFT steps leave every sample wrong, and DAPO's dynamic sampling would then find no
        // group to keep; rl-e2e's learn.rs runs it on a warmed-up policy
        ("RL_ALGORITHM__FILTER_GROUPS__ENABLE", "false"),
    ];
    for block in &blocks {
        run(&env, block, &shrink);
    }
    assert!(
        env.path().join("runs/grpo.png").is_file(),
        "the tour's plot"
    );
}
