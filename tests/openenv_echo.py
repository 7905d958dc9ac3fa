"""An OpenEnv echo environment served with openenv-core's own helpers (`create_app` under uvicorn), for tests.

The environment: `reset` greets (its observation's `text`, with the record's `seed` when given); each `step` echoes
the action's `message` back, with reward 0.1 x its length, and the episode is done after 2 steps. Every environment
instance (one per WebSocket session) appends `open <id>` to the session log when made and `close <id>` when the
server closes it, and `step <id> <length>` per step, so a test can count sessions and steps from outside.

    python tests/openenv_echo.py PORT LOG [--slow SECONDS] [--max-sessions N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State, create_app

LOG = os.environ.get("ECHO_ENV_LOG", os.devnull)
SLOW = float(os.environ.get("ECHO_ENV_SLOW", "0"))
_ids = itertools.count()


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    text: str = ""


def _log(line: str) -> None:
    with open(LOG, "a") as f:
        f.write(line + "\n")


class EchoEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.id = f"{os.getpid()}-{next(_ids)}"
        self.steps = 0
        _log(f"open {self.id}")

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> EchoObservation:
        self.steps = 0
        return EchoObservation(text=f"Say something (game {seed}).", reward=None, done=False)

    def step(self, action: EchoAction, timeout_s: Optional[float] = None, **kwargs: Any) -> EchoObservation:
        if SLOW:
            time.sleep(SLOW)
        self.steps += 1
        _log(f"step {self.id} {len(action.message)}")
        return EchoObservation(text=f"You said: {action.message[:40]}", reward=0.1 * len(action.message),
                               done=self.steps >= 2)

    @property
    def state(self) -> State:
        return State(step_count=self.steps)

    def close(self) -> None:
        _log(f"close {self.id}")


def app(max_sessions: int = 64):
    return create_app(EchoEnv, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=max_sessions)


if __name__ == "__main__":
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("log")
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--max-sessions", type=int, default=64)
    a = p.parse_args()
    LOG, SLOW = a.log, a.slow
    uvicorn.run(app(a.max_sessions), host="127.0.0.1", port=a.port, log_level="warning")
