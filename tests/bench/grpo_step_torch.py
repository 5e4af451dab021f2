"""One GRPO step on SmolLM2-135M-Instruct in plain PyTorch + transformers, timed like the Rust
trainer's `timing_s/*` (gen / old_log_prob / ref / update), for docs/perf.md.

By default the shape of `tests/tests/smollm2.rs`: 8 single-digit addition prompts x 4 samples, 16
new tokens, temperature 1, float32 on CPU, PPO-clip + low-var-KL loss (token-mean), AdamW. With
`--data PARQUET` the prompts are that file's rows in order (verl's schema, chat messages), scored
by GSM8K's strict `#### N` (the word-problem recipe's shape: `--prompts 8 --n 8 --new 128`); with
`--no-kl` there is no reference model and no separate old-log-prob forward (one on-policy update:
the old log-probs are the update's own, detached), as the harness does when no KL term is used.

Usage: .venv/bin/python tests/bench/grpo_step_torch.py models/smollm2-135m-instruct [steps]
           [--data PARQUET] [--prompts 8] [--n 4] [--new 16] [--no-kl] [--micro ROWS]
"""

import argparse
import json
import random
import re
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def word_problems(path):
    """(chat messages, ground truth) of a verl-schema parquet, in file order."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    return [([{"role": m["role"], "content": m["content"]} for m in r["prompt"]], r["reward_model"]["ground_truth"]) for r in rows]


def strict_gsm8k(text, truth):
    found = re.findall(r"#### (\-?[0-9\.\,]+)", text[-300:])
    return 1.0 if found and found[-1].replace(",", "").rstrip(".") == truth else 0.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("steps", type=int, nargs="?", default=2)
    p.add_argument("--data")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--no-kl", action="store_true")
    p.add_argument("--micro", type=int, default=0, help="rows per forward and backward of the update (0: all)")
    args = p.parse_args()
    path, steps = args.path, args.steps
    torch.manual_seed(0)
    random.seed(0)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ref = None
    if not args.no_kl:
        ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        for q in ref.parameters():
            q.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    n, new = args.n, args.new
    rows = word_problems(args.data) if args.data else None
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos

    def log_probs(m, ids, attn, resp_len):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = m(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -resp_len - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, -resp_len:].unsqueeze(-1)).squeeze(-1)

    for step in range(steps):
        if rows is None:
            pairs = [(random.randint(0, 9), random.randint(0, 9)) for _ in range(args.prompts)]
            chats = [[{"role": "user", "content": f"What is {a} + {b}? Give the final answer as a number on the last line."}]
                     for a, b in pairs]
            truths = [str(a + b) for a, b in pairs]
        else:
            batch = rows[step * args.prompts:(step + 1) * args.prompts]
            chats, truths = [c for c, _ in batch], [t for _, t in batch]
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                num_return_sequences=n, pad_token_id=pad,
            )
        t_gen = time.perf_counter() - t0
        prompt_len = enc["input_ids"].shape[1]
        resp = out[:, prompt_len:]
        resp_len = resp.shape[1]
        # response mask: up to and including the first eos
        is_eos = resp == eos
        after = (is_eos.cumsum(-1) - is_eos.long()) > 0
        mask = (~after).float()
        attn = torch.cat([enc["attention_mask"].repeat_interleave(n, 0), mask.long()], 1)
        texts_out = tok.batch_decode(resp, skip_special_tokens=True)
        scores = []
        for i, t in enumerate(texts_out):
            if rows is None:
                nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", t)
                scores.append(1.0 if nums and float(nums[-1].replace(",", "")) == float(truths[i // n]) else 0.0)
            else:
                scores.append(strict_gsm8k(t, truths[i // n]))
        scores = torch.tensor(scores).view(-1, n)
        adv = ((scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + 1e-6)).view(-1, 1) * mask
        t_old = t_ref = 0.0
        if ref is not None:
            t0 = time.perf_counter()
            with torch.no_grad():
                old = log_probs(model, out, attn, resp_len)
            t_old = time.perf_counter() - t0
            t0 = time.perf_counter()
            with torch.no_grad():
                ref_lp = log_probs(ref, out, attn, resp_len)
            t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.zero_grad()
        # gradient accumulation over micro-batches of rows; the loss is the token-mean over all
        rows, tokens = out.shape[0], mask.sum()
        micro = args.micro or rows
        for lo in range(0, rows, micro):
            part = slice(lo, lo + micro)
            lp = log_probs(model, out[part], attn[part], resp_len)
            old_part = lp.detach() if ref is None else old[part]
            ratio = torch.exp((lp - old_part).clamp(-20, 20))
            a = adv[part]
            loss_tok = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
            if ref is not None:
                kl = ref_lp[part] - lp
                k3 = (torch.exp(kl.clamp(-20, 20)) - kl - 1).clamp(-10, 10)
                loss_tok = loss_tok + 0.001 * k3
            ((loss_tok * mask[part]).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t_update = time.perf_counter() - t0
        total = t_gen + t_old + t_ref + t_update
        print(json.dumps({
            "step": step + 1, "gen": round(t_gen, 3), "old_log_prob": round(t_old, 3), "ref": round(t_ref, 3),
            "update_actor": round(t_update, 3), "total": round(total, 3), "score": scores.mean().item(),
            "response_length": mask.sum(-1).mean().item(), "prompt_length": enc["attention_mask"].sum(-1).float().mean().item(),
            "threads": torch.get_num_threads(),
        }))


if __name__ == "__main__":
    main()
