"""The Python half of the prompt-pipeline benchmark, doing what verl's RLHFDataset + collate do:
read verl-schema parquet with pyarrow, render each prompt with transformers' apply_chat_template,
tokenise in batches of 1024 with the fast (Rust `tokenizers`) tokenizer, left-pad into torch
tensors with verl's position ids, and carry the non-tensor columns.

Usage: .venv/bin/python rl-data/benches/pipeline_python.py <in.parquet> <tokenizer_dir>
Prints one JSON line of figures (same fields as the Rust half).
"""

import json
import sys
import time

import pyarrow.parquet as pq
import torch
from transformers import AutoTokenizer


def main():
    parquet, tok_dir = sys.argv[1], sys.argv[2]
    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    table = pq.read_table(parquet, columns=["data_source", "prompt", "reward_model", "extra_info"])
    prompts = table.column("prompt").to_pylist()
    data_source = table.column("data_source").to_pylist()
    reward_model = table.column("reward_model").to_pylist()
    extra_info = table.column("extra_info").to_pylist()
    rows = tokens = checksum = 0
    for lo in range(0, len(prompts), 1024):
        batch = prompts[lo : lo + 1024]
        texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in batch]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), pad_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.int64)
        for i, x in enumerate(ids):
            input_ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.int64)
            attention_mask[i, width - len(x) :] = 1
        position_ids = torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
        _ = (data_source[lo : lo + 1024], [r["ground_truth"] for r in reward_model[lo : lo + 1024]],
             extra_info[lo : lo + 1024], position_ids)
        rows += len(ids)
        tokens += int(attention_mask.sum())
        checksum += int((input_ids * attention_mask).sum())
    secs = time.perf_counter() - start
    print(json.dumps({"impl": "python", "rows": rows, "secs": round(secs, 3),
                      "rows_per_s": round(rows / secs, 1), "tokens": tokens, "checksum": checksum}))


if __name__ == "__main__":
    main()
