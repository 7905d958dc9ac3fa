"""Environment failures across a run: a warning line the first time each kind occurs, and a stop when too many of
one step's trajectories failed.

A trajectory whose environment timed out, crashed, raised or returned the wrong type ended with finish reason
`env_error` and carries `env_errors` (1), `env_error` (the text), `env_error_kind` (e.g. `step timeout`) and
`env_error_record` (the record's file and line, when known) in its summary (`posttrain.agent.rollout`). `EnvErrorWatch.check` reads a step's summaries: each kind not seen before
is one warning line (later ones are counted in `agent/env_errors` only), and when more than
`max_fraction` of the step's trajectories failed it raises `EnvironmentFailedError`, whose message is the run's
one `error:` line, naming the environment class, the first error (its method) and its record.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["EnvErrorWatch", "EnvironmentFailedError", "env_watch"]


class EnvironmentFailedError(RuntimeError):
    """More than the allowed fraction of a step's trajectories failed in the environment."""


class EnvErrorWatch:
    """Watches a run's trajectories for environment failures (see the module docstring). `env_name`: the
    environment class's name; `warn(line)` prints a warning line; `key`: the config key of `max_fraction`."""

    def __init__(self, env_name: str, max_fraction: float, warn: Callable[[str], None],
                 key: str = "rollout.max_env_error_fraction"):
        self.env_name, self.max_fraction, self.warn, self.key = env_name, float(max_fraction), warn, key
        self.seen: set[str] = set()

    def check(self, step: int, trajectories: Sequence[dict]) -> None:
        """Warns once per new kind; raises `EnvironmentFailedError` when too many of the step's trajectories failed."""
        failed = [t for t in trajectories if t.get("env_errors")]
        for t in failed:
            kind = t.get("env_error_kind", "error")
            if kind not in self.seen:
                self.seen.add(kind)
                self.warn(f"environment {self.env_name}: {kind} at step {step}, the trajectory ended: "
                          f"{_error(t)} (counted in agent/env_errors; this kind is not printed again)")
        if trajectories and len(failed) / len(trajectories) > self.max_fraction:
            raise EnvironmentFailedError(
                f"environment {self.env_name}: {len(failed)} of {len(trajectories)} trajectories of step {step} "
                f"failed, more than {self.key}={self.max_fraction:g}; first error: {_error(failed[0])}")


def _error(trajectory: dict) -> str:
    """A failed trajectory's error text, with its record when known."""
    where = trajectory.get("env_error_record")
    return trajectory.get("env_error", "") + (f" ({where})" if where else "")


def env_watch(agent, max_fraction: float, say: Callable[[str], None]) -> EnvErrorWatch | None:
    """The watch over an `agent`'s environment failures, stopping past `max_fraction` of a step's trajectories (None
    without an environment); its warnings go to `say`."""
    if agent is None or agent.environment is None:
        return None
    return EnvErrorWatch(agent.environment.name, max_fraction, warn=lambda line: say(f"warning: {line}"))
