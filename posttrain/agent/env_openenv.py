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

It sits behind the environment protocol (`posttrain.agent.environments`) as the session's backend
(`OpenEnvBackend`): every call (connecting and `reset`, each `step`) has the environment's time limit
(`rollout.tool_timeout_s`): past it the call fails as a `timeout` and the session is closed, and the socket's own
time-outs bound it too, so a server that is down, slow, hangs up or answers garbage ends that trajectory as
`env_error`, one line naming `OpenEnv[URL]` and the method, counted like any environment's failures; never a hang.
The session is closed when the trajectory ends, when a call fails and when it times out. This is our own client
(the `websockets` package, which openenv-core's client uses too): it runs on threads of the trainer's process (no
user code to isolate), and a run needs no openenv-core (whose server side pulls in gradio and an MCP stack); the
tests check it against openenv-core's own server.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import threading
from typing import Any

from posttrain.agent.environments import EnvironmentSpec

__all__ = ["OpenEnvBackend", "OpenEnvConfig", "OpenEnvError", "OpenEnvSession", "OpenEnvTimeout", "load_openenv",
           "observation_text", "ws_url"]

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


class OpenEnvTimeout(TimeoutError):
    """A call to an OpenEnv server ran past its time limit (its session is closed)."""

    consequence = "its session was closed"


class OpenEnvSession:
    """One WebSocket session with the OpenEnv server at `url` (its `/ws` endpoint): `reset(record, timeout)`
    (connects when not connected, then resets: a new episode), `step(text, timeout) -> (observation or None,
    reward, done)`, `close()`. Every failure is an `OpenEnvError`, after which the session is closed."""

    def __init__(self, url: str, cfg: OpenEnvConfig | None = None):
        self.url, self.cfg = url, cfg or OpenEnvConfig()
        self._ws = None
        self._lock = threading.Lock()
        self._busy = False  # a call is waiting for its answer
        self.closed = False

    # ------------------------------------------------------------------ transport
    def _fail(self, what: str) -> OpenEnvError:
        self.close()
        return OpenEnvError(what)

    def _connect(self, timeout: float | None) -> None:
        from websockets.exceptions import InvalidHandshake, InvalidURI
        from websockets.sync.client import connect

        try:
            ws = connect(self.url, open_timeout=timeout, close_timeout=1.0, ping_interval=None,
                         max_size=int(self.cfg.max_message_mb * 2**20))
        except TimeoutError:
            raise self._fail(f"no connection within {timeout:g}s") from None
        except (OSError, InvalidHandshake, InvalidURI) as e:
            raise self._fail(f"cannot connect ({type(e).__name__}: {' '.join(str(e).split())})") from None
        with self._lock:
            if self.closed:  # closed meanwhile (a time-out): the new connection goes too
                ws.close()
                raise self._fail("the session was closed")
            self._ws = ws

    def _call(self, message: dict, what: str, timeout: float | None) -> dict:
        """Send `message`, and read the observation answer's data."""
        from websockets.exceptions import ConnectionClosed

        ws = self._ws
        if ws is None:
            raise self._fail(f"{what}: the session is closed")
        try:
            self._busy = True
            ws.send(json.dumps(message))
            raw = ws.recv(timeout=timeout)
            self._busy = False
        except TimeoutError:
            raise self._fail(f"{what}: no answer within {timeout:g}s") from None
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
    def reset(self, record: dict, timeout: float | None = 10.0) -> list[dict]:
        """Reset the session's environment with the record's fields (connecting first when not connected): the
        first user turn."""
        if self._ws is None:
            self.closed = False
            self._connect(timeout)
        text, _, _ = self._read(self._call({"type": "reset", "data": _json_safe(record)}, "reset", timeout), "reset")
        return [{"role": "user", "content": text}]

    def step(self, text: str, timeout: float | None = 10.0) -> tuple[str | None, float, bool]:
        """The model's turn as the action: (the next user turn, or None when done; the turn's reward; done). The
        session is closed when the game is over."""
        data = self._call({"type": "step", "data": {self.cfg.action_field: text}}, "step", timeout)
        obs, reward, done = self._read(data, "step")
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


class OpenEnvBackend:
    """One trajectory's OpenEnv session as the environment protocol's backend (`EnvBackend`): `reset` and `step`
    each run on a thread of their own (our client, not user code: nothing to isolate in a process), and their Future
    fails with `OpenEnvTimeout` at the call's time limit (the session is closed then, which ends the call) or with
    the `OpenEnvError` the call met."""

    def __init__(self, url: str, cfg: OpenEnvConfig):
        self.session = OpenEnvSession(url, cfg)

    def call(self, method: str, args: tuple = (), kwargs: dict | None = None, *, timeout: float | None,
             fresh: bool = False, offered: bool = False) -> cf.Future:
        out: cf.Future = cf.Future()

        def settle(result=None, error: BaseException | None = None) -> None:
            try:
                out.set_exception(error) if error is not None else out.set_result(result)
            except cf.InvalidStateError:  # the time limit came first
                pass

        def run() -> None:
            try:
                if method not in ("reset", "step"):
                    raise OpenEnvError(f"an OpenEnv environment has no method {method!r}")
                settle(getattr(self.session, method)(*args, timeout=timeout))
            except BaseException as e:  # noqa: BLE001 - the call's outcome, whatever it is
                settle(error=e)

        def expire() -> None:
            if not out.done():
                settle(error=OpenEnvTimeout(f"{method}: no answer within {timeout:g}s"))
                self.session.close()

        threading.Thread(target=run, name=f"openenv-{method}", daemon=True).start()
        if timeout is not None:
            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            timer.start()
            out.add_done_callback(lambda _: timer.cancel())
        return out

    def close(self) -> None:
        self.session.close()


def load_openenv(ref: str, cfg: OpenEnvConfig | None = None, key: str = "rollout.environment") -> EnvironmentSpec:
    """The environment `openenv:URL` names: each session a WebSocket session with the server (errors name `key`).
    Nothing is contacted here: the first `reset` connects."""
    url = ref[len(PREFIX):].strip() if ref.startswith(PREFIX) else ref.strip()
    if not url or any(ch.isspace() for ch in url):
        raise ValueError(f"{key}: {ref!r} must be openenv:URL with the server's http(s):// or ws(s):// address")
    endpoint, cfg = ws_url(url), cfg or OpenEnvConfig()
    return EnvironmentSpec(name=f"OpenEnv[{endpoint}]", ref=ref, tool_names=(), schemas=(), has_step=True,
                           has_reward=False, open=lambda pool: OpenEnvBackend(endpoint, cfg))
