"""The word-problem recipe's GRPO step on SmolLM2-135M-Instruct, three ways, interleaved so that
load cannot flatter any of them (issue 48's speed target):

- "before": the release harness as the step was measured when issue 48 was filed: a reference
  forward for a KL term (`use_kl_loss=true`, low-var-KL, coefficient 0.001) and each sample's
  prompt computed with it (no prefix sharing);
- "recipe": the same step as experiments/smollm2_word_problems_grpo.toml runs it: no KL term, so
  no reference forward, and a group's shared prompt computed once in the update's forward and
  backward (`use_prefix_grouper=true`);
- "pytorch": the recipe's step in plain PyTorch + transformers (tests/bench/grpo_step_torch.py
  --no-kl: generate, one forward and backward with the log-probs detached as the old ones).

Shape: 8 word-problem prompts (data/smollm2-word-problems/train.parquet) x 8 samples x at most 128
new tokens at temperature 1, from the base model (which writes prose, so most samples run long),
float32, the same intra-op thread count on every side. Each side is a fresh process doing one
step; the phases come from the harness's `timing_s/*` metrics and the script's own timers. The
ratios are formed within a round; the verdict rule is rl-workers/benches/side_by_side.py's.

The floor is the time of the work's matrix products at the rate PyTorch reaches here on a large
product (2048 x 576 x 1536, f32): the 30 layers' 106.2M multiplied parameters for each group's
prompt once and for every response token, the 28.3M of the tied head for the response tokens
only; 2 FLOPs a parameter for the generation's forward, 6 for the update's forward and backward.
Attention, the softmax and everything else are left out; our projections run on oneDNN, which can
beat PyTorch's MKL rate here (docs/perf.md), so a phase can come in under this floor.

Run from the repository root (after scripts/import-smollm2, scripts/reference-env and
`harness data word-problems data/smollm2-word-problems --train 2000 --test 200 --seed 0
--test-phrasing 2`):
  .venv/bin/python tests/bench/grpo_real_step_side_by_side.py [--rounds 3] [--threads 2] [--json-out F]
"""
import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "rl-workers", "benches"))
from side_by_side import spread, verdict  # noqa: E402

PHASES = ["gen", "old_log_prob", "ref", "update_actor", "step"]
P_BODY = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
P_HEAD = 49152 * 576
PROMPTS, N, NEW = 8, 8, 128
# rows per forward and backward of the update, on every side (the recipe's micro-batch)
MICRO = 16


def load():
    return os.getloadavg()[0]


def ours(harness, data, model, threads, recipe, seed):
    db = tempfile.mktemp(suffix=".db", dir=tempfile.gettempdir())
    overrides = [
        f"trainer.db={db}", "trainer.experiment_name=bench", "trainer.total_training_steps=1",
        "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.seed={seed}", f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}", f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet",
        f"data.train_batch_size={PROMPTS}", f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.rollout.n={N}", f"data.max_response_length={NEW}",
        f"actor_rollout_ref.rollout.response_length={NEW}", "actor_rollout_ref.rollout.temperature=1.0",
        f"trainer.export_dir={tempfile.mkdtemp()}", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}",
    ]
    if recipe:
        overrides += ["actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.use_prefix_grouper=true"]
    else:
        overrides += ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001",
                      "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                      "actor_rollout_ref.actor.use_prefix_grouper=false"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    run = subprocess.run([harness, "train", os.path.join(ROOT, "experiments", "smollm2_word_problems_grpo.toml"),
                          *overrides], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"grpo_real_step_side_by_side: our step failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    con = sqlite3.connect(db)
    m = dict(con.execute("select key, value from metrics where step = 1").fetchall())
    con.close()
    os.remove(db)
    return {
        "gen": m["timing_s/gen"], "old_log_prob": m.get("timing_s/old_log_prob", 0.0), "ref": m.get("timing_s/ref", 0.0), "update_actor": m["timing_s/update_actor"],
        "step": m["timing_s/step"], "response_length": m["response_length/mean"],
        "prompt_length": m["prompt_length/mean"], "pg_loss": m["actor/pg_loss"], "score": m["critic/score/mean"],
    }


def pytorch(python, data, model, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([python, os.path.join(ROOT, "tests", "bench", "grpo_step_torch.py"), model, "1",
                          "--data", f"{data}/train.parquet", "--prompts", str(PROMPTS), "--n", str(N),
                          "--new", str(NEW), "--no-kl", "--micro", str(MICRO)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"grpo_real_step_side_by_side: the PyTorch step failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    out = out.stdout
    t = json.loads(out.strip().splitlines()[-1])
    return {"gen": t["gen"], "old_log_prob": t["old_log_prob"], "ref": t["ref"], "update_actor": t["update_actor"], "step": t["total"],
            "response_length": t["response_length"], "prompt_length": t["prompt_length"], "score": t["score"]}


def product_rate(threads):
    """This machine's best f32 product rate in PyTorch (GFLOP/s) at 2048 rows x 576 x 1536."""
    import torch

    torch.set_num_threads(threads)
    a, w = torch.randn(2048, 576), torch.randn(576, 1536)
    best = float("inf")
    for _ in range(5):
        t0, k = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.2:
            a @ w
            k += 1
        best = min(best, (time.perf_counter() - t0) / k)
    return 2 * 2048 * 576 * 1536 / best / 1e9


def floors(side, rate):
    """The products' time (s) of the generation and of the recipe's update at `rate` GFLOP/s:
    the body's products for each prompt once and every response token, the head's for the
    response tokens only (2 FLOPs per multiplied parameter forward, 6 forward and backward)."""
    prompt, resp = side["prompt_length"], side["response_length"]
    body_tokens = PROMPTS * prompt + PROMPTS * N * resp
    flops = P_BODY * body_tokens + P_HEAD * PROMPTS * N * resp
    return {"gen": 2 * flops / rate / 1e9, "update_actor": 6 * flops / rate / 1e9}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--harness", default=os.path.join(ROOT, "target", "release", "harness"))
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "smollm2-word-problems"))
    p.add_argument("--json-out")
    args = p.parse_args()
    if args.rounds < 3:
        p.error("--rounds must be at least 3: fewer cannot show a spread worth a verdict")
    for need in (args.harness, os.path.join(args.model, "model.safetensors"), os.path.join(args.data, "train.parquet")):
        if not os.path.exists(need):
            sys.exit(f"grpo_real_step_side_by_side: {need} is missing (see this script's docstring)")
    rate = product_rate(args.threads)
    print(f"product rate: {rate:.0f} GFLOP/s ({args.threads} threads, PyTorch, 2048 x 576 x 1536)", file=sys.stderr)
    rounds = []
    for r in range(args.rounds):
        one = {"load_avg_before": {}}
        # the same prompts and samples for both of ours: a seed per round
        for side in ("before", "recipe", "pytorch"):
            one["load_avg_before"][side] = load()
            if side == "pytorch":
                one[side] = pytorch(sys.executable, args.data, args.model, args.threads)
            else:
                one[side] = ours(args.harness, args.data, args.model, args.threads, side == "recipe", r + 1)
            print(f"round {r + 1}/{args.rounds} {side}: load {one['load_avg_before'][side]:.2f}, "
                  f"step {one[side]['step']:.1f} s ({json.dumps(one[side])})", file=sys.stderr)
        one["floor"] = floors(one["recipe"], rate)
        one["recipe/before"] = {k: one["recipe"][k] / one["before"][k] for k in PHASES if one["before"][k] > 0}
        one["recipe/pytorch"] = {k: one["recipe"][k] / one["pytorch"][k] for k in PHASES if one["pytorch"][k] > 0}
        one["recipe/floor"] = {k: one["recipe"][k] / one["floor"][k] for k in one["floor"]}
        rounds.append(one)
    summary = {"rounds": rounds, "threads": args.threads, "product_rate_gflops": rate}
    print("| phase | before (s) | recipe (s) | PyTorch + transformers, recipe's step (s) | recipe / before | recipe / PyTorch | recipe / floor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")

    def cell(values):
        s = spread(values)
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    for k in PHASES:
        cols = [cell([x[side][k] for x in rounds]) for side in ("before", "recipe", "pytorch")]
        for ratio in ("recipe/before", "recipe/pytorch", "recipe/floor"):
            vals = [x[ratio][k] for x in rounds if k in x[ratio]]
            if len(vals) < len(rounds):
                cols.append("-")
                continue
            if ratio == "recipe/floor":
                cols.append(cell(vals))
                continue
            side, _ = verdict(vals, None, "lower")
            other = "before" if ratio == "recipe/before" else "PyTorch"
            side = side.replace("ours better", "recipe faster").replace("transformers better", f"{other} faster")
            cols.append(f"{cell(vals)}, {side}")
        print(f"| {k} | " + " | ".join(cols) + " |")
    for side in ("before", "recipe", "pytorch"):
        rl = statistics.median(x[side]["response_length"] for x in rounds)
        pl = statistics.median(x[side]["prompt_length"] for x in rounds)
        print(f"{side}: median response length {rl:.1f} tokens, prompt {pl:.1f} tokens")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
