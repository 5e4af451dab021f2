"""Drives `harness serve` with the official OpenAI client (scripts/client-env), as agent code
would; prints one JSON object of what it saw for rl-harness/tests/serve.rs to check.

    .venv-client/bin/python rl-harness/tests/serve/client.py BASE_URL PROMPT_IDS_JSON
"""
import json
import sys

import openai

base_url, prompt_ids = sys.argv[1], json.loads(sys.argv[2])
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
out = {}

out["models"] = [m.id for m in client.models.list().data]
model = out["models"][0]

# greedy from token ids, with the token ids back (vLLM's return_token_ids)
c = client.completions.create(
    model=model, prompt=prompt_ids, max_tokens=8, temperature=0, logprobs=1,
    extra_body={"return_token_ids": True, "ignore_eos": True},
)
choice = c.choices[0]
out["greedy"] = {
    "text": choice.text,
    "token_ids": choice.model_extra["token_ids"],
    "prompt_token_ids": choice.model_extra["prompt_token_ids"],
    "token_logprobs": choice.logprobs.token_logprobs,
    "finish_reason": choice.finish_reason,
    "usage": c.usage.model_dump(),
}

# chat, n samples, seeded, with log-probs
chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "12+34="}], max_tokens=6, n=2, seed=3,
    logprobs=True, extra_body={"return_token_ids": True},
)
out["chat"] = [
    {
        "content": ch.message.content,
        "role": ch.message.role,
        "token_ids": ch.model_extra["token_ids"],
        "logprobs": [t.logprob for t in ch.logprobs.content],
        "finish_reason": ch.finish_reason,
    }
    for ch in chat.choices
]

# the same chat streamed: the deltas add up to the same contents
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "12+34="}], max_tokens=6, n=2, seed=3,
    stream=True,
)
texts, finishes = ["", ""], [None, None]
for chunk in stream:
    for ch in chunk.choices:
        texts[ch.index] += ch.delta.content or ""
        finishes[ch.index] = ch.finish_reason or finishes[ch.index]
out["chat_streamed"] = {"contents": texts, "finish_reasons": finishes}

# a refused field comes back as the client's BadRequestError, with our message
try:
    client.completions.create(model=model, prompt="1", presence_penalty=0.5)
    out["bad_request"] = None
except openai.BadRequestError as e:
    out["bad_request"] = {"status": e.status_code, "message": e.body["message"]}

print(json.dumps(out))
