"""A GRPO step's phases, ours against the plain PyTorch + transformers loop, interleaved so that
load cannot flatter either side (issue 25).

Each round runs one GRPO step of SmolLM2-135M-Instruct on each side, back to back in their own
processes with the same intra-op thread count: ours is `tests/tests/smollm2.rs` (the harness's
GRPO trainer: 8 single-digit addition prompts x 4 samples, 16 new tokens at temperature 1,
PPO-clip + low-var-KL, AdamW), the reference `tests/bench/grpo_step_torch.py` (the same work in
PyTorch 2.13 + transformers 4.57). Each phase's ratio (ours / PyTorch time) is formed within a
round and reported as the median and the spread over the rounds, with a verdict only where every
round agrees (rl-workers/benches/side_by_side.py's rule).

Run from the repository root (after scripts/import-smollm2 and scripts/reference-env):
  .venv/bin/python tests/bench/grpo_step_side_by_side.py [--rounds 3] [--threads 2] [--json-out F]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "rl-workers", "benches"))
from side_by_side import spread, verdict  # noqa: E402

PHASES = ["gen", "old_log_prob", "ref", "update_actor"]
RUST_LINE = re.compile(
    r"smollm2 grpo step \d+: step ([\d.]+)s = gen ([\d.]+)s \+ reward ([\d.]+)s \+ old_log_prob (skipped|[\d.]+s)"
    r" \+ ref ([\d.]+)s \+ adv ([\d.]+)s \+ update_actor ([\d.]+)s")


def load():
    return os.getloadavg()[0]


def rust_binary():
    out = subprocess.run(
        ["cargo", "test", "-p", "rl-e2e", "--test", "smollm2", "--no-run", "--message-format=json", "-q"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["name"] == "smollm2":
            return msg["executable"]
    sys.exit("grpo_step_side_by_side: cargo built no smollm2 test binary")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--json-out")
    args = p.parse_args()
    if args.rounds < 3:
        p.error("--rounds must be at least 3: fewer cannot show a spread worth a verdict")
    binary = rust_binary()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), SMOLLM2_STEPS="1")
    rounds = []
    for r in range(args.rounds):
        load_rust = load()
        out = subprocess.run([binary, "--exact", "grpo_on_smollm2_completes", "--nocapture"], cwd=os.path.join(ROOT, "tests"),
                             env=env, check=True, capture_output=True, text=True).stdout
        m = RUST_LINE.search(out)
        if m is None:
            sys.exit(f"grpo_step_side_by_side: no step line in the Rust test's output:\n{out}")
        # an on-policy update supplies its old log-probs: ours then runs no such forward (0 s)
        old = 0.0 if m.group(4) == "skipped" else float(m.group(4)[:-1])
        step, gen, _reward, ref, _adv, update = map(float, m.group(1, 2, 3, 5, 6, 7))
        ours = {"gen": gen, "old_log_prob": old, "ref": ref, "update_actor": update, "step": step}
        load_torch = load()
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "bench", "grpo_step_torch.py"), args.model, "1"],
                             env=env, check=True, capture_output=True, text=True).stdout
        theirs = json.loads(out.strip().splitlines()[-1])
        theirs["step"] = theirs["total"]
        one = {"ours": ours, "pytorch": {k: theirs[k] for k in PHASES + ["step"]},
               "load_avg_before_ours": load_rust, "load_avg_before_pytorch": load_torch,
               "ratios": {k: ours[k] / theirs[k] for k in PHASES + ["step"]}}
        rounds.append(one)
        print(f"round {r + 1}/{args.rounds}: load {load_rust:.2f} / {load_torch:.2f}, step {ours['step']:.2f} s vs "
              f"{theirs['step']:.2f} s", file=sys.stderr)
    summary = {"rounds": rounds, "threads": args.threads, "ratios": {}, "sides": {}}
    print("| phase | ours (s) | PyTorch + transformers (s) | ours / PyTorch, median | spread | which is faster |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for k in PHASES + ["step"]:
        ratios = [x["ratios"][k] for x in rounds]
        side, _ = verdict(ratios, None, "lower")
        s = spread(ratios)
        summary["ratios"][k] = s
        o = spread([x["ours"][k] for x in rounds])
        t = spread([x["pytorch"][k] for x in rounds])
        summary["sides"][k] = {"ours": o, "pytorch": t}
        print(f"| {k} | {o['median']:.2f} ({o['min']:.2f}-{o['max']:.2f}) | {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f}) "
              f"| {s['median']:.2f} | {s['min']:.2f} - {s['max']:.2f} | {side.replace('ours better', 'ours').replace('transformers better', 'PyTorch')} |")
    if args.json_out:
        json.dump(summary, open(args.json_out, "w"), indent=1)


if __name__ == "__main__":
    main()
