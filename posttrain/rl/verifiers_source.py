"""RL on a verifiers environment (`rollout.environment=verifiers:NAME_OR_FILE`): the in-process rollout source whose
rollouts the environment runs.

`VerifiersSource` serves the run's policy on 127.0.0.1 (`posttrain.serve.local.serve_policy`: the same
OpenAI-compatible server `posttrain serve` runs, over the local `Policy`, from a background thread) and hands each lease's
rows to the environment (`posttrain.rollout.verifiers_env.VerifiersEnvironment`, in its worker process), whose OpenAI
client talks to that server: every turn the environment asks for is sampled by our sampler with the latest weights
(`publish` swaps them into the server's engine between steps), and comes back with the ids it sampled, which are
the ids trained on. The rubric's reward is the reward.
"""

from __future__ import annotations

import time

from posttrain.config import ConfigError
from posttrain.rl.config import FleetConfig, PromptData, RewardsSection, RolloutConfig
from posttrain.rl.sources import GroupIntake
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import PromptSet
from posttrain.rollout.rollouts import Rollouts
from posttrain.rollout.verifiers_env import VerifiersEnvironment
from posttrain.sampling import SamplingParams
from posttrain.serve.local import SERVED_NAME, serve_policy

__all__ = ["VerifiersSource", "open_verifiers"]

def open_verifiers(rollout: RolloutConfig, rewards: RewardsSection, data: PromptData,
                   fleet: FleetConfig) -> VerifiersEnvironment:
    """The run's verifiers environment (`rollout.environment`, `rollout.environment_args`), checked against what it
    replaces: its rubric gives the rewards (`rewards.functions` stay at their default or are set to none), its
    dataset the prompts (no `data.train`, `data.eval`), sampled in-process (not on the fleet)."""
    if rewards.functions and rewards.functions != RewardsSection().functions:
        raise ConfigError("rewards.functions: a verifiers environment's rubric gives the rewards; set none "
                          "(rewards.functions=[])")
    for key, value in (("data.train", data.train), ("data.eval", data.eval)):
        if value:
            raise ConfigError(f"{key}: a verifiers environment's dataset gives the prompts; leave {key} unset "
                              "(evaluate with posttrain eval --environment verifiers:...)")
    if fleet.enabled:
        raise ConfigError("fleet.workers: verifiers environments run in-process (leave fleet.workers unset)")
    try:
        return VerifiersEnvironment.open(rollout.environment, rollout.environment_args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


class VerifiersSource:
    """Synchronous RL through a verifiers environment (module docstring); staleness 0."""

    def __init__(self, intake: GroupIntake, policy: Policy, env: VerifiersEnvironment, prompts: PromptSet,
                 params: SamplingParams, *, slots: int, system_prompt: str | None = None):
        self.intake, self.env, self.prompts, self.params = intake, env, prompts, params
        self.server = serve_policy(policy, slots=slots, system_prompt=system_prompt)
        self.version: int | None = None
        self._t_generate = 0.0
        self._counts: dict[str, float] = {}

    def publish(self, params, version: int) -> None:
        self.server.engine.swap_weights(SERVED_NAME, params, version).result()
        self.version = version

    def next(self, step: int) -> Rollouts:
        self._counts = {}
        return self.intake.take(step, self._produce)

    def _produce(self, step: int) -> None:
        d = self.intake.dispatcher
        lease = d.lease("local", max(1, d.admissible(step - 1, self.version)))
        t0 = time.perf_counter()
        ro, counts = self.env.rollouts(self.prompts, lease.records, self.params, f"{self.server.url}/v1",
                                       SERVED_NAME, uids=lease.uids, version=int(self.version or 0))
        self._t_generate += time.perf_counter() - t0
        for k, v in counts.items():
            self._counts[k] = self._counts.get(k, 0.0) + v
        self.intake.complete(lease.id, ro)

    def commit(self, rollouts: Rollouts) -> list[int]:
        return self.intake.commit(rollouts)

    def metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        out = self.intake.figures(step, rollouts) | dict(self._counts)
        out["time/generate_s"], self._t_generate = self._t_generate, 0.0
        return out

    def close(self) -> None:
        self.server.stop()
