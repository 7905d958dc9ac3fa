"""OpenEnv environments: `rollout.environment=openenv:URL`, a server speaking OpenEnv's WebSocket protocol
(`openenv-core`'s `create_app`, a Hugging Face Space, a container), played as a text game.

One WebSocket session per trajectory: OpenEnv's HTTP `/reset` and `/step` make a fresh environment per call, so an
episode needs the session (`URL/ws`; `http(s)://` becomes `ws(s)://`). The messages, as openenv-core 0.3.0 sends
and answers them:

    -> {"type": "reset", "data": {...record fields}}       <- {"type": "observation", "data": {"observation": {..},
    -> {"type": "step", "data": {ACTION_FIELD: text}}                                  "reward": r, "done": d}}
    -> {"type": "close"}                                    <- {"type": "error", "data": {"message", "code"}}

`reset` gets the dataset record's fields (the server passes on those its environment's `reset` takes, e.g. `seed`)
and its observation is the first user turn; each assistant turn is one `step` whose action is
`{action_field: the turn's text}` (`OpenEnvConfig`), whose observation is the next user turn, whose reward is the
turn's reward (None: 0) and whose `done` ends the game. The text of an observation: its `observation_field`, else
its one string field, else the first of text, message, content, prompt it has, else its JSON.

Every call (connect and reset, step) has the environment's time limit (`rollout.tool_timeout_s`), enforced by the
socket itself (connect, send and receive time-outs), so a server that is down, slow or answers garbage is an
`OpenEnvError` within the limit, never a hang: the trajectory ends as `env_error`, its one line naming the session
class, `OpenEnv[URL]`, and the method. The session is closed when the trajectory ends, when a call fails and when
it times out. This is our own client (the `websockets` package, which openenv-core's client uses too): it runs in
the trainer's process, and a run needs no openenv-core (whose server side pulls in gradio and an MCP stack); the
tests check it against openenv-core's own server.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from typing import Any

from posttrain.agent.environments import EnvironmentSpec

__all__ = ["OpenEnvConfig", "OpenEnvError", "OpenEnvSession", "load_openenv", "observation_text", "ws_url"]

PREFIX = "openenv:"
_TEXT_FIELDS = ("text", "message", "content", "prompt")


@dataclasses.dataclass
class OpenEnvConfig:
    """How text maps to an OpenEnv environment's actions and observations (`rollout.openenv`).

    action_field: the action's field that holds the model's turn (the action is `{action_field: text}`).
    observation_field: the observation's field that is the next user turn; None: its one string field, else the
      first of text, message, content, prompt it has, else the observation's JSON.
    max_message_mb: the largest message the server may send (MiB); a larger one fails the call.
    """

    action_field: str = "message"
    observation_field: str | None = None
    max_message_mb: float = 16.0

    def __post_init__(self):
        if not self.action_field:
            raise ValueError("rollout.openenv.action_field must name the action's text field (default: message)")
        if not self.max_message_mb > 0:
            raise ValueError(f"rollout.openenv.max_message_mb must be > 0, found {self.max_message_mb}")


class OpenEnvError(RuntimeError):
    """A call to an OpenEnv server failed (refused, timed out, closed, an error answer, or garbage): one line (the
    session's class name, `OpenEnv[URL]`, says which server)."""


def ws_url(url: str) -> str:
    """The session endpoint of an OpenEnv server at `url` (http(s):// or ws(s):// or host:port): `ws(s)://.../ws`."""
    url = url.strip().rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(http):
            url = ws + url[len(http):]
    if not url.startswith(("ws://", "wss://")):
        url = "ws://" + url
    return url if url.endswith("/ws") else url + "/ws"


def observation_text(obs: Any, field: str | None = None) -> str:
    """The user turn an observation stands for (see the module docstring); KeyError naming the fields when
    `field` is not one of them."""
    if not isinstance(obs, dict):
        return obs if isinstance(obs, str) else json.dumps(obs)
    if field is not None:
        if field not in obs:
            raise KeyError(f"the observation has no field {field!r} (rollout.openenv.observation_field); its fields: "
                           f"{sorted(obs)}")
        value = obs[field]
        return value if isinstance(value, str) else json.dumps(value)
    strings = {k: v for k, v in obs.items() if isinstance(v, str)}
    if len(strings) == 1:
        return next(iter(strings.values()))
    named = next((k for k in _TEXT_FIELDS if k in strings), None)
    return strings[named] if named is not None else json.dumps(obs, sort_keys=True)


def _reward(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, (str, bytes)) or not isinstance(value, (int, float)):
        raise TypeError(f"reward must be a number or null, got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise TypeError(f"reward {value} is not finite")
    return float(value)


def _json_safe(record: dict) -> dict:
    """The record's fields that JSON can carry (others, e.g. images, are left out)."""
    out = {}
    for k, v in record.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        out[k] = v
    return out


class OpenEnvSession:
    """One trajectory's WebSocket session with an OpenEnv server: `reset(record)` (connects, then resets),
    `step(text) -> (observation or None, reward, done)`, `close()`. Every failure is an `OpenEnvError`, after
    which the session is closed. Made with no arguments by the environment loader (`load_openenv` binds
    the URL, the config and the time limit as class attributes)."""

    url: str = ""
    cfg: OpenEnvConfig = OpenEnvConfig()
    timeout_s: float | None = 10.0

    def __init__(self):
        self._ws = None
        self._lock = threading.Lock()
        self._busy = False  # a call is waiting for its answer
        self.closed = False

    # ------------------------------------------------------------------ transport
    def _fail(self, what: str) -> OpenEnvError:
        self.close()
        return OpenEnvError(what)

    def _connect(self) -> None:
        from websockets.exceptions import InvalidHandshake, InvalidURI
        from websockets.sync.client import connect

        try:
            ws = connect(self.url, open_timeout=self.timeout_s, close_timeout=1.0, ping_interval=None,
                         max_size=int(self.cfg.max_message_mb * 2**20))
        except TimeoutError:
            raise self._fail(f"no connection within {self.timeout_s:g}s") from None
        except (OSError, InvalidHandshake, InvalidURI) as e:
            raise self._fail(f"cannot connect ({type(e).__name__}: {' '.join(str(e).split())})") from None
        with self._lock:
            if self.closed:  # closed meanwhile (a time-out): the new connection goes too
                ws.close()
                raise self._fail("the session was closed")
            self._ws = ws

    def _call(self, message: dict, what: str) -> dict:
        """Send `message`, and read the observation answer's data."""
        from websockets.exceptions import ConnectionClosed

        ws = self._ws
        if ws is None:
            raise self._fail(f"{what}: the session is closed")
        try:
            self._busy = True
            ws.send(json.dumps(message))
            raw = ws.recv(timeout=self.timeout_s)
            self._busy = False
        except TimeoutError:
            raise self._fail(f"{what}: no answer within {self.timeout_s:g}s") from None
        except ConnectionClosed as e:
            raise self._fail(f"{what}: the server closed the session ({e})") from None
        except (OSError, RuntimeError) as e:
            raise self._fail(f"{what}: {type(e).__name__}: {e}") from None
        try:
            answer = json.loads(raw)
        except (TypeError, ValueError):
            raise self._fail(f"{what}: the answer is not JSON: {str(raw)[:100]!r}") from None
        kind = answer.get("type") if isinstance(answer, dict) else None
        data = answer.get("data") if isinstance(answer, dict) else None
        if kind == "error":
            detail = data if isinstance(data, dict) else {}
            raise self._fail(f"{what}: server error {detail.get('code', '?')}: "
                             f"{' '.join(str(detail.get('message', data)).split())[:300]}")
        if kind != "observation" or not isinstance(data, dict):
            raise self._fail(f"{what}: expected an observation answer, got {str(raw)[:100]!r}")
        return data

    def _read(self, data: dict, what: str) -> tuple[str, float, bool]:
        try:
            return observation_text(data.get("observation", {}), self.cfg.observation_field), \
                _reward(data.get("reward")), bool(data.get("done", False))
        except (KeyError, TypeError) as e:
            raise self._fail(f"{what}: {e.args[0] if e.args else e}") from None

    # ------------------------------------------------------------------ the environment's methods
    def reset(self, record: dict) -> list[dict]:
        """Open the session and reset its environment with the record's fields: the first user turn."""
        self._connect()
        text, _, _ = self._read(self._call({"type": "reset", "data": _json_safe(record)}, "reset"), "reset")
        return [{"role": "user", "content": text}]

    def step(self, text: str) -> tuple[str | None, float, bool]:
        """The model's turn as the action: (the next user turn, or None when done; the turn's reward; done). The
        session is closed when the game is over."""
        obs, reward, done = self._read(self._call({"type": "step", "data": {self.cfg.action_field: text}}, "step"),
                                       "step")
        if done:
            self.close()
        return (None if done else obs), reward, done

    def close(self) -> None:
        """End the session: between calls, say `close` and let the server close the connection (a second at
        most); while a call waits (a time-out from another thread), close the connection at once, which ends
        that call. Safe from any thread, and more than once."""
        with self._lock:
            ws, self._ws, self.closed = self._ws, None, True
        if ws is None:
            return
        from websockets.exceptions import ConnectionClosed

        if not self._busy:
            try:
                ws.send(json.dumps({"type": "close"}))
                ws.recv(timeout=1.0)  # the server ends its session, then closes the connection
            except (ConnectionClosed, TimeoutError, OSError, RuntimeError):
                pass
        try:
            ws.close()
        except Exception:  # noqa: BLE001 - best effort: the connection may be gone already
            pass


def load_openenv(ref: str, cfg: OpenEnvConfig | None = None, timeout_s: float | None = 10.0,
                 key: str = "rollout.environment") -> EnvironmentSpec:
    """The environment `openenv:URL` names: a session class bound to the URL, `cfg` and the time limit (errors
    name `key`). Nothing is contacted here: the first trajectory's `reset` connects."""
    url = ref[len(PREFIX):].strip() if ref.startswith(PREFIX) else ref.strip()
    if not url or any(ch.isspace() for ch in url):
        raise ValueError(f"{key}: {ref!r} must be openenv:URL with the server's http(s):// or ws(s):// address")
    endpoint = ws_url(url)
    session = type(f"OpenEnv[{endpoint}]", (OpenEnvSession,),
                   {"url": endpoint, "cfg": cfg or OpenEnvConfig(), "timeout_s": timeout_s})
    return EnvironmentSpec(cls=session, ref=ref, tool_names=(), schemas=(), has_step=True, has_reward=False,
                           closes=True)
