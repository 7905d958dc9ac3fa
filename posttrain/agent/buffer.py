"""The token buffer of one trajectory: every id the model saw, in order, with what the loss needs.

Sampled ids (the model's own tokens, with their log-probs) have loss mask 1; appended ids (the prompt, tool
results, observations, the next turn's header) have mask 0 and log-prob NaN. `turns[i]` is the assistant
turn that token i belongs to or follows (0 for the prompt and the first answer, 1 from the first appended
tool result on...). Nothing in the buffer is ever re-tokenized.

The sampler records a sequence's tokens once (its slot record, handed over as the `Completion`: every id after
the prompt, log-probs, mask 1 sampled / 0 appended); a trajectory's buffer is read from it when the sequence is
done (`TokenBuffer.from_completion`), not recorded a second time while it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["TokenBuffer"]


@dataclass
class TokenBuffer:
    """ids, loss_mask, logprobs and turn index per token, grown by `add_prompt`/`add_sampled`/`add_appended`."""
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    turn: int = 0  # the current turn: advanced by `add_appended` after a sampled turn

    def __len__(self) -> int:
        return len(self.ids)

    def _extend(self, ids: Sequence[int], mask: int, logprobs: Sequence[float]) -> None:
        ids = [int(i) for i in ids]
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} ids but {len(logprobs)} log-probs")
        self.ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += [float(p) for p in logprobs]
        self.turns += [self.turn] * len(ids)

    def add_prompt(self, ids: Sequence[int]) -> None:
        """The rendered prompt (mask 0): only at the start."""
        if self.ids:
            raise ValueError("the prompt goes first, into an empty buffer")
        self._extend(ids, 0, [math.nan] * len(ids))

    def add_sampled(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Tokens the model sampled, with their log-probs (mask 1)."""
        self._extend(ids, 1, logprobs)

    def add_appended(self, ids: Sequence[int]) -> None:
        """Tokens we add after a model turn (tool results, observations, next header): mask 0, new turn."""
        if self.loss_mask and self.loss_mask[-1] == 1:
            self.turn += 1
        self._extend(ids, 0, [math.nan] * len(ids))

    @classmethod
    def from_completion(cls, prompt_ids: Sequence[int], completion) -> TokenBuffer:
        """The buffer of a finished sequence, read from the sampler's record of it: the prompt (mask 0), then the
        completion's ids (`token_ids`, every id after the prompt) run by run of equal `mask` (None: all sampled),
        sampled runs with their `logprobs`, appended runs (mask 0) starting a new turn, as `add_sampled` and
        `add_appended` would have built it turn by turn."""
        buf = cls()
        buf.add_prompt(prompt_ids)
        ids, lps = list(completion.token_ids), list(completion.logprobs)
        mask = [1] * len(ids) if completion.mask is None else [int(m) for m in completion.mask]
        if not len(ids) == len(lps) == len(mask):
            raise ValueError(f"a completion of {len(ids)} ids with {len(lps)} log-probs and {len(mask)} mask entries")
        start = 0
        for end in range(1, len(ids) + 1):
            if end == len(ids) or mask[end] != mask[start]:
                if mask[start]:
                    buf.add_sampled(ids[start:end], lps[start:end])
                else:
                    buf.add_appended(ids[start:end])
                start = end
        return buf

    @property
    def sampled_ids(self) -> list[int]:
        return [i for i, m in zip(self.ids, self.loss_mask) if m]

    def last_turn_ids(self) -> list[int]:
        """The ids sampled in the current (last) turn."""
        return [i for i, m, t in zip(self.ids, self.loss_mask, self.turns) if m and t == self.turn]

    def arrays(self) -> dict[str, np.ndarray]:
        """`token_ids` (int32), `loss_mask` (int8), `logprobs` (float32), `turns` (int32)."""
        return {"token_ids": np.asarray(self.ids, np.int32), "loss_mask": np.asarray(self.loss_mask, np.int8),
                "logprobs": np.asarray(self.logprobs, np.float32), "turns": np.asarray(self.turns, np.int32)}
