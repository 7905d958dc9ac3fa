"""Held-out exact-answer accuracy of a vision-language checkpoint on image prompts (the VLM smoke run's measure).

Greedy decoding, uncached: prompts (the chat template's user turn with its image, the generation prompt) are
left-padded into one buffer of prompt + `max_new_tokens` columns; each step runs the model over the whole buffer
(one compiled shape) and writes the arg-max token after the last one. Answers end at an end-of-sequence id and
are scored with the `exact_answer` reward. Usage:

    python -m posttrain.demo.vlm_eval CHECKPOINT "shapes:?size=200&seed=2"
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

from flax import nnx
import jax.numpy as jnp
import numpy as np

from posttrain.data.sources import read_prompts
from posttrain.data.vlm import VisionSpec, encode_image_prompt
from posttrain.rewards.exact import exact_answer
from posttrain.rollout.policy import Policy

__all__ = ["greedy_answers", "vlm_accuracy"]


def greedy_answers(model, tok, spec: VisionSpec, prompts: Sequence, *, max_new_tokens: int = 8,
                   batch_size: int = 64) -> list[str]:
    """The greedy completion (decoded, up to the first end-of-sequence id) of every image prompt."""
    out: list[str] = []
    step = nnx.jit(lambda m, ids, mask, px: jnp.argmax(m(ids, attention_mask=mask, pixel_values=px), axis=-1))
    for s in range(0, len(prompts), batch_size):
        enc = [encode_image_prompt(p, tok, spec, f"prompt {s + i + 1}") for i, p in enumerate(prompts[s:s + batch_size])]
        p_len = max(len(ids) for ids, _ in enc)
        width = p_len + max_new_tokens
        ids = np.full((len(enc), width), tok.pad_token_id or 0, np.int32)
        mask = np.zeros((len(enc), width), np.int32)
        for r, (x, _) in enumerate(enc):
            ids[r, p_len - len(x):p_len] = x
            mask[r, p_len - len(x):] = 1  # the generated columns count as real once written (causal: no peeking)
        px = jnp.asarray(np.concatenate([p for _, p in enc]))
        for t in range(max_new_tokens):
            nxt = np.asarray(step(model, jnp.asarray(ids), jnp.asarray(mask), px))[:, p_len + t - 1]
            ids[:, p_len + t] = nxt
        for r in range(len(enc)):
            gen = ids[r, p_len:].tolist()
            cut = next((i for i, t in enumerate(gen) if t in tok.eos_token_ids), len(gen))
            out.append(tok.decode(gen[:cut]))
    return out


def vlm_accuracy(checkpoint: str, source: str, *, max_new_tokens: int = 8) -> dict:
    """{"accuracy", "n", "samples"}: exact-answer accuracy of `checkpoint` on the prompts of `source`."""
    policy = Policy.open(checkpoint, mesh=None, max_slots=1)  # its model, tokenizer and vision spec
    recs = read_prompts(source, required_fields=("answer",))
    answers = greedy_answers(policy.model, policy.tokenizer, policy.encoder.vision, [r["prompt"] for r in recs],
                             max_new_tokens=max_new_tokens)
    scores = exact_answer(None, answers, [r["answer"] for r in recs])
    return {"accuracy": float(np.mean(scores)), "n": len(recs),
            "samples": [{"answer": a, "gold": r["answer"]} for a, r in zip(answers[:8], recs[:8])]}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("source")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    a = ap.parse_args(argv)
    print(json.dumps(vlm_accuracy(a.checkpoint, a.source, max_new_tokens=a.max_new_tokens)))


if __name__ == "__main__":
    main()
