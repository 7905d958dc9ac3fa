"""A policy served in-process: the OpenAI-compatible endpoint a verifiers environment's client talks to during RL
(`posttrain.rl.verifiers_source`) and evaluation (`posttrain.eval.verifiers_eval`), and the one a judge reward given
as a local checkpoint asks (`serve_judges`).

`serve_policy(policy)` is `posttrain serve` over a `Policy` the caller already holds (its model and sampler shared,
not copied), on 127.0.0.1 at a free port, from a background thread; conversations go through the checkpoint's chat
template (`system_prompt` when given). The caller swaps weights with `server.engine.swap_weights(SERVED_NAME, ...)`
(on the engine's thread, between decode segments) and ends it with `server.stop()`.

`serve_judges(runner)`: every `judge` reward of a `RewardRunner` whose `model` is a local checkpoint (no `url`) gets
it opened as a `Policy` (chat template) and served so; its requests then go there, batched by the serving engine
like any client's, and the server stops when the runner closes. Judges naming the same checkpoint share one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.models.prompt_format import PromptStyle
from posttrain.rewards.judge import Judge
from posttrain.rewards.runner import RewardRunner
from posttrain.rollout.policy import Policy
from posttrain.serve.config import ServeConfig
from posttrain.serve.models import ServedModel

if TYPE_CHECKING:
    from posttrain.serve.server import Server

__all__ = ["SERVED_NAME", "serve_judges", "serve_policy"]

SERVED_NAME = "policy"  # the model name clients ask for


def serve_policy(policy: Policy, *, slots: int, system_prompt: str | None = None) -> Server:
    """`policy` served on 127.0.0.1 (module docstring), `slots` sequences decoded at once; started."""
    from posttrain.serve.server import Server  # lazy: the HTTP stack (FastAPI, uvicorn) only when served

    chat = Policy(policy.model, policy.tokenizer, style=PromptStyle(chat=True, system_prompt=system_prompt),
                  sampler=policy.sampler)
    config = ServeConfig(model=SERVED_NAME, port=0, max_slots=max(1, slots), warmup=False)
    return Server(config, models={SERVED_NAME: ServedModel(chat)}).start()


def serve_judges(runner: RewardRunner, *, dtype: str = "float32", slots: int = 8) -> list[Server]:
    """Serves the local judges of `runner` (module docstring); returns the servers started (stopped at its close)."""
    servers: dict[str, Server] = {}
    for fn in runner.functions:
        if not isinstance(fn, Judge) or fn.spec is None:
            continue
        if fn.spec not in servers:
            policy = Policy.open(fn.spec, dtype=dtype, default_chat=True, max_slots=slots)
            servers[fn.spec] = serve_policy(policy, slots=slots)
            runner.on_close(servers[fn.spec].stop)
        fn.serve_at(f"{servers[fn.spec].url}/v1", SERVED_NAME)
    return list(servers.values())
