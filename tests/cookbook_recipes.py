"""Runs tinker-cookbook's own `recipes/sl_loop.py` or `recipes/rl_loop.py`, unchanged, against a Tinker server, offline.

Run by tests/test_tinker_cookbook.py with the python of the cookbook's own virtual environment (tinker-cookbook
pins transformers<=5.5.4, so it cannot share posttrain's environment; this file imports nothing of posttrain):

    python tests/cookbook_recipes.py {sl,rl} URL MODEL TOKENIZER_FOLDER LOG_PATH [field=value ...]

The recipes' `main` and `Config` are the cookbook's; only what they would fetch from a hub is replaced, from
outside, as docs/tutorials/tinker.md tells a user to: the tokenizer (the served model's folder, through the
cookbook's `register_tokenizer`), the renderer (`role_colon`, for a model the cookbook does not know) and the data
set (local rows instead of `datasets.load_dataset`). For the RL recipe the reward too: a random tiny model never
writes GSM8K's `\\boxed{}` answers, so every group would tie and no importance-sampling step would run; the
recipe's module-level `get_reward` is replaced by a local task such a model scores on (the share of vowels)."""

from __future__ import annotations

import os
import sys

import chz
import datasets
from transformers import AutoTokenizer

from tinker_cookbook import model_info, tokenizer_utils

WORDS = ("apple", "pear", "plum", "fig", "kiwi", "lime", "date", "peach")


def sl_rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
            for w in WORDS]


def rl_rows() -> list[dict]:
    return [{"question": f"Name a fruit like {w}.", "answer": f"#### {len(w)}"} for w in WORDS]


def vowel_share(response: str, answer: str) -> float:
    """The local RL task: the share of vowels in the answer (a random model's samples differ on it)."""
    return sum(c in "aeiou" for c in response) / max(len(response), 1)


def main(argv: list[str]) -> None:
    kind, url, model, folder, log_path, *overrides = argv
    os.environ.setdefault("TINKER_API_KEY", "tml-cookbook")
    tokenizer_utils.register_tokenizer(model, lambda: AutoTokenizer.from_pretrained(folder))
    model_info.get_recommended_renderer_name = lambda name: "role_colon"
    rows = sl_rows() if kind == "sl" else rl_rows()
    datasets.load_dataset = lambda *a, **k: datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    if kind == "sl":
        from tinker_cookbook.recipes import sl_loop as recipe
    else:
        from tinker_cookbook.recipes import rl_loop as recipe
        recipe.get_reward = vowel_share
    argv = [f"base_url={url}", f"model_name={model}", f"log_path={log_path}", *overrides]
    chz.nested_entrypoint(recipe.main, argv=argv)  # the recipe's own command line, as `python -m ...` parses it


if __name__ == "__main__":
    main(sys.argv[1:])
