"""A rollout worker: a Ray actor with its own devices, model, `Sampler` and reward process pool.

Each `rollout` call is one lease: pull the newest weights from the parameter server if they are newer
than the ones loaded (every trainer process's chunks, assembled for this worker's own model: staged into the sampler's model between calls, never during one), generate the
leased groups (a group's samples depend only on (seed, uid, weights)), score them with the reward runner
(time limits, failures counted), and return the scored groups stamped with the weights' version and the
sampler's per-token log-probs. The actor keeps no state the run needs: Ray restarts a dead one
(`max_restarts`) and the dispatcher re-queues whatever it held. `heartbeat` answers from a second
thread while a rollout runs (what the worker is doing, since when, and its busy seconds).

Multi-turn rollouts (`rollout.tools` / `rollout.environment`): the worker builds its own `Agent` from the
rollout section and its tokenizer (`posttrain.agent.setup.build_agent`, with the data section's system prompt
and prompt field), runs the tools and environments itself, and returns the completion masks and trajectory
summaries with the groups; `close` (called by the trainer at the end of the run) shuts its tool processes.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Mapping

import ray

from posttrain.agent.setup import agent_enabled, build_agent
from posttrain.models import tokenizer as tok_lib
from posttrain.rl.config import PromptData, RewardsSection, RolloutConfig
from posttrain.rl.fleet.shards import assemble
from posttrain.rl.rewarding import reward_runner, rollout_sampling_params
from posttrain.rl.rollout import generate_rollouts
from posttrain.sampling import Sampler
from posttrain.training.config import LoraConfig, ModelSection
from posttrain.training.run import build_model

__all__ = ["RolloutWorker"]


class RolloutWorker:
    """One rollout worker (module docstring). Built in Ray from plain, picklable config sections: the run's
    `model` and `lora` (the trainer's structure, so published weights load as they are), `rollout`, `rewards`,
    the resolved algorithm `preset` (a mapping: DAPO's overlong penalty), the run's `seed`, and its `data`
    section (multi-turn rollouts: the system prompt and prompt field of the worker's `Agent`)."""

    def __init__(self, name: str, param_server, *, model: ModelSection, lora: LoraConfig, rollout: RolloutConfig,
                 rewards: RewardsSection, preset: Mapping, seed: int, data: PromptData | None = None):
        self.name, self.ps = name, param_server
        self._state, self._since, self.busy_s = "starting", time.time(), 0.0
        net, folder = build_model(model, lora, seed)  # the trainer's structure (LoRA included), own devices
        slots = rollout.max_slots or rollout.batch_prompts * rollout.group_size
        tok = tok_lib.load(folder)
        self.sampler = Sampler(net, tok, max_slots=slots)
        self.agent = None
        if agent_enabled(rollout):
            data = data or PromptData()
            self.agent = build_agent(rollout, tok, system_prompt=data.system_prompt, prompt_field=data.prompt_field)
        self.runner = reward_runner(rewards, rollout, preset)
        self.params = rollout_sampling_params(rollout, seed)
        self.version = -1
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
            self.sampler.load_weights(assemble(ray.get(refs)), version)
            self.version = version
            return time.perf_counter() - t0
        return 0.0

    def rollout(self, lease_id: int, uids: list[int], records: dict, record_indices: list[int],
                prompt_ids: list[list[int]]) -> dict:
        t0 = time.perf_counter()
        pull_s = self._pull()
        self._set("generating")
        ro = generate_rollouts(self.sampler, records, record_indices, prompt_ids, self.params, self.runner, uids=uids,
                               agent=self.agent)
        self._set("idle")
        seconds = time.perf_counter() - t0
        self.busy_s += seconds
        return {"lease": lease_id, "rollouts": ro, "worker": self.name, "pull_s": pull_s, "seconds": seconds,
                "tokens": int(ro.completion_lengths().sum())}

    def close(self) -> None:
        """Shuts the agent's tool threads and processes (multi-turn rollouts); the actor is killed after."""
        if self.agent is not None:
            self.agent.close()
            self.agent = None
