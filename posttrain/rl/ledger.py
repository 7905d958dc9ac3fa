"""The RL run's row files: `trained.jsonl`, the ledger of trained groups (per step: their uids and records,
policy versions and staleness; from it "every prompt trained exactly once" is checked), and `samples.jsonl`
(a training sample per logged step, greedy held-out samples per evaluation) and, for multi-turn rollouts,
`trajectories.jsonl` (a few trajectories per logged step: messages, tool calls and results, token ids, loss
mask, log-probs, turns, finish reason). On a multi-host run only
process 0 writes them; the others write nowhere."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from posttrain.rollout.rollouts import Rollouts

__all__ = ["Ledger", "ROW_FILES"]

ROW_FILES = ("samples.jsonl", "trained.jsonl", "trajectories.jsonl")  # rows of steps after a restored checkpoint are dropped


class Ledger:
    """`trained.jsonl` and `samples.jsonl` of the run folder `out`, opened for appending."""

    def __init__(self, out: Path, primary: bool = True):
        self.samples = open(out / "samples.jsonl" if primary else os.devnull, "a", encoding="utf-8")
        self.trained = open(out / "trained.jsonl" if primary else os.devnull, "a", encoding="utf-8")
        self.trajectories = open(out / "trajectories.jsonl" if primary else os.devnull, "a", encoding="utf-8")

    def record_trained(self, step: int, ro: Rollouts, uids: list[int]) -> None:
        """The step's trained groups: uids, record indices, policy versions and the largest staleness."""
        versions = np.asarray(ro.version_first)
        self.trained.write(json.dumps({
            "step": step, "uids": uids, "records": [int(ro.record_index[j * ro.group_size])
                                                   for j in range(ro.num_groups)],
            "version_min": int(versions.min()), "version_max": int(np.max(ro.version_last)),
            "staleness_max": int((step - 1) - versions.min()), "time": time.time()}) + "\n")
        self.trained.flush()

    def record_samples(self, step: int, kind: str, ro: Rollouts, n: int) -> None:
        """The first `n` samples of `ro` (prompt, completion, reward) under `kind` ("train" or "eval"); a multi-turn
        sample's row has the whole conversation too (`messages`: the prompt's, every assistant turn, tool results)."""
        for i in range(min(n, len(ro))):
            conversation = {"messages": ro.trajectories[i]["messages"]} if i < len(ro.trajectories) else {}
            self.samples.write(json.dumps({"step": step, "kind": kind, "prompt": ro.prompts_text[i],
                                           "completion": ro.texts[i], "reward": float(ro.rewards[i]),
                                           **conversation}, ensure_ascii=False) + "\n")
        self.samples.flush()

    def record_trajectories(self, step: int, kind: str, ro: Rollouts, n: int) -> None:
        """The first `n` trajectories of multi-turn rollouts (nothing for single-turn ones), and up to `n` more
        that the environment failed (`env_error`): the conversation, and the token ids after the prompt with their
        loss mask and log-probs (None where not sampled)."""
        first = list(range(min(n, len(ro.trajectories))))
        failed = [i for i in range(len(first), len(ro.trajectories)) if ro.trajectories[i].get("env_errors")]
        for i in first + failed[:n]:
            mask = ro.completion_mask[i]
            self.trajectories.write(json.dumps({
                "step": step, "kind": kind, "uid": ro.uid[i] if ro.uid else None, "reward": float(ro.rewards[i]),
                **ro.trajectories[i], "prompt_ids": ro.prompt_ids[i], "token_ids": ro.completion_ids[i],
                "loss_mask": mask, "logprobs": [float(p) if m else None for p, m in zip(ro.logprobs[i], mask)]},
                ensure_ascii=False) + "\n")
        self.trajectories.flush()

    def close(self) -> None:
        for f in (self.samples, self.trained, self.trajectories):
            f.close()
