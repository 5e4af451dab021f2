"""One GRPO step on SmolLM2-135M-Instruct in plain PyTorch + transformers, timed like the Rust
trainer's `timing_s/*` (gen / old_log_prob / ref / update), for docs/perf.md.

Same shape as `tests/tests/smollm2.rs`: 8 single-digit addition prompts x 4 samples, 16 new tokens,
temperature 1, float32 on CPU, PPO-clip + low-var-KL loss (token-mean), AdamW.

Usage: .venv/bin/python tests/bench/grpo_step_torch.py models/smollm2-135m-instruct [steps]
"""

import json
import random
import re
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    path = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.manual_seed(0)
    random.seed(0)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    n, new = 4, 16
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos

    def log_probs(m, ids, attn, resp_len):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = m(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -resp_len - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, -resp_len:].unsqueeze(-1)).squeeze(-1)

    for step in range(steps):
        pairs = [(random.randint(0, 9), random.randint(0, 9)) for _ in range(8)]
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": f"What is {a} + {b}? Give the final answer as a number on the last line."}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for a, b in pairs
        ]
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
            a, b = pairs[i // n]
            nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", t)
            scores.append(1.0 if nums and float(nums[-1].replace(",", "")) == a + b else 0.0)
        scores = torch.tensor(scores).view(-1, n)
        adv = ((scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + 1e-6)).view(-1, 1) * mask
        t0 = time.perf_counter()
        with torch.no_grad():
            old = log_probs(model, out, attn, resp_len)
        t_old = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            ref_lp = log_probs(ref, out, attn, resp_len)
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        lp = log_probs(model, out, attn, resp_len)
        ratio = torch.exp((lp - old).clamp(-20, 20))
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        kl = ref_lp - lp
        k3 = (torch.exp(kl.clamp(-20, 20)) - kl - 1).clamp(-10, 10)
        loss = ((pg + 0.001 * k3) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t_update = time.perf_counter() - t0
        total = t_gen + t_old + t_ref + t_update
        print(json.dumps({
            "step": step + 1, "gen": round(t_gen, 3), "old_log_prob": round(t_old, 3), "ref": round(t_ref, 3),
            "update_actor": round(t_update, 3), "total": round(total, 3), "score": scores.mean().item(),
            "response_length": mask.sum(-1).mean().item(), "threads": torch.get_num_threads(),
        }))


if __name__ == "__main__":
    main()
