"""A rollout worker: a Ray actor with its own devices, model (a `Policy` over it) and reward process pool.

Each `rollout` call is one lease, its prompts as `Prompt` items (token ids, images, record, record index: image
prompts travel with their pixels): pull the newest weights from the parameter server if they are newer
than the ones loaded (every trainer process's chunks, assembled for this worker's own model and loaded into
the policy's model), generate the leased groups (a group's samples depend only on (seed, uid, weights)),
score them with the reward runner (time limits, failures counted), and return the scored groups stamped
with the weights' versions and the sampler's per-token log-probs.

Partial rollouts (`fleet.swap=segment`): between decode segments of a lease the worker also takes newer
weights (`Policy.sample(between_segments=...)`, the KV caches in flight kept), so a long completion is not
generated with the weights its lease started with to its end: each token carries the version that produced
it. The check costs no wait: one `latest()` call to the parameter server is in flight at a time, issued at
most every `POLL_S`, and read only once it has answered; only a newer version is fetched (that fetch and
the copy into the model are the swap's cost, counted in the result's `swaps` and `swap_s`). The actor keeps no state the run needs: Ray restarts a dead one
(`max_restarts`) and the dispatcher re-queues whatever it held. `heartbeat` answers from a second
thread while a rollout runs (what the worker is doing, since when, and its busy seconds).

Multi-turn rollouts (`rollout.tools` / `rollout.environment`): the worker builds its own `Agent` from the
rollout section and its tokenizer (`posttrain.agent.setup.build_agent`, with the data section's system prompt
and prompt field), runs the tools and environments itself, and returns the completion masks and trajectory
summaries with the groups; `close` (called by the trainer at the end of the run) shuts its tool processes.

Routing replay (`learner.routing_replay`, a mixture of experts: `record_experts`): the worker's sampler records the
experts it routed every fed token to, and the returned rollouts carry them (`Rollouts.routed_experts`).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Sequence

import ray

from posttrain.agent.setup import agent_enabled, build_agent
from posttrain.algorithms.registry import GRPOFamily
from posttrain.models import tokenizer as tok_lib
from posttrain.rl.config import FleetConfig, PromptData, RewardsSection, RolloutConfig
from posttrain.rl.fleet.shards import assemble
from posttrain.rl.rewarding import reward_runner, rollout_sampling_params
from posttrain.rollout.collect import generate_rollouts
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import Prompt
from posttrain.training.config import LoraConfig, ModelSection
from posttrain.training.run import build_model

__all__ = ["RolloutWorker"]

POLL_S = 0.05  # fleet.swap=segment: at most one `latest()` call to the parameter server this often


class RolloutWorker:
    """One rollout worker (module docstring). Built in Ray from plain, picklable config sections: the run's
    `model` and `lora` (the trainer's structure, so published weights load as they are), `rollout`, `rewards`,
    the typed algorithm `preset` (`GRPOFamily`: DAPO's overlong penalty), the run's `seed`, and its `data`
    section (multi-turn rollouts: the system prompt and prompt field of the worker's `Agent`), the `fleet`
    section (`swap`, `segment_steps`) and `record_experts` (routing replay: `learner.routing_replay`)."""

    def __init__(self, name: str, param_server, *, model: ModelSection, lora: LoraConfig, rollout: RolloutConfig,
                 rewards: RewardsSection, preset: GRPOFamily, seed: int, data: PromptData | None = None,
                 fleet: FleetConfig | None = None, record_experts: bool = False):
        self.name, self.ps = name, param_server
        fleet = fleet or FleetConfig()
        # how every lease generates: newer weights between decode segments (fleet.swap=segment), experts recorded
        self.generate_kw = {"between_segments": self._newer if fleet.swap == "segment" else None,
                            "record_experts": record_experts}
        self._state, self._since, self.busy_s = "starting", time.time(), 0.0
        net, folder = build_model(model, lora, seed)  # the trainer's structure (LoRA included), own devices
        tok = tok_lib.load(folder)
        # the sampler's own compute dtype (`rollout.compute_dtype`; its weights: as sent)
        self.policy = Policy(net, tok, folder=folder, max_slots=rollout.slots,
                             segment_steps=fleet.segment_steps or None, compute_dtype=rollout.compute_dtype)
        self.agent = None
        if agent_enabled(rollout):
            data = data or PromptData()
            self.agent = build_agent(rollout, tok, system_prompt=data.system_prompt, prompt_field=data.prompt_field)
        self.runner = reward_runner(rewards, rollout, preset)
        self.params = rollout_sampling_params(rollout, seed)
        self.version = -1
        self._poll, self._polled = None, 0.0  # segment swaps: the `latest()` call in flight, when it was sent
        self._swaps, self._swap_s = 0, 0.0  # this lease's
        self._set("idle")

    def _set(self, state: str) -> None:
        self._state, self._since = state, time.time()

    def ready(self) -> dict:
        return {"name": self.name, "pid": os.getpid(), "host": socket.gethostname(),
                "node": ray.get_runtime_context().get_node_id(), "version": self.version}

    def heartbeat(self) -> dict:
        return {"state": self._state, "since": self._since, "version": self.version, "busy_s": self.busy_s}

    def _pull(self) -> float:
        t0 = time.perf_counter()
        self._set("pulling")
        version, refs = ray.get(self.ps.latest.remote())
        if version > self.version:
            self.policy.swap_weights(assemble(ray.get(refs)), version)
            self.version = version
            return time.perf_counter() - t0
        return 0.0

    def _newer(self):
        """Between decode segments (fleet.swap=segment): `(weights, version)` when the parameter server has
        answered with a version newer than the loaded one, else None (module docstring: never a wait)."""
        if self._poll is None:
            if time.monotonic() - self._polled >= POLL_S:
                self._poll, self._polled = self.ps.latest.remote(), time.monotonic()
            return None
        if not ray.wait([self._poll], timeout=0)[0]:
            return None
        version, refs = ray.get(self._poll)
        self._poll = None
        if version <= self.version:
            return None
        t0 = time.perf_counter()
        self._set("pulling")
        weights = assemble(ray.get(refs))
        self._set("generating")
        self.version = version
        self._swaps += 1
        self._swap_s += time.perf_counter() - t0  # the fetch; the copy into the model follows in the policy
        return weights, version

    def rollout(self, lease_id: int, uids: list[int], prompts: Sequence[Prompt]) -> dict:
        """One lease: its groups' `Prompt` items (ids, images, record, record index), one per uid, generated with
        the newest weights and scored (module docstring)."""
        t0 = time.perf_counter()
        pull_s = self._pull()
        self._set("generating")
        self._swaps, self._swap_s = 0, 0.0
        ro = generate_rollouts(self.policy, prompts, self.params, self.runner, uids=uids, agent=self.agent,
                               **self.generate_kw)
        self._set("idle")
        seconds = time.perf_counter() - t0
        self.busy_s += seconds
        return {"lease": lease_id, "rollouts": ro, "worker": self.name, "pull_s": pull_s, "seconds": seconds,
                "tokens": int(ro.completion_lengths().sum()), "swaps": self._swaps, "swap_s": self._swap_s}

    def close(self) -> None:
        """Shuts the agent's tool threads and processes (multi-turn rollouts); the actor is killed after."""
        if self.agent is not None:
            self.agent.close()
            self.agent = None
