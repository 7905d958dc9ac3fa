"""OpenEnv environments (`rollout.environment=openenv:URL`) against a real OpenEnv server on 127.0.0.1, served by
openenv-core's own `create_app` under uvicorn (`tests/openenv_echo.py`: reward 0.1 x the reply's length, done after
2 steps), one per module: one WebSocket session per trajectory, reset -> first user turn, step -> observation,
reward, done; every session closed; a server that is down, silent, closes on us or answers garbage is one error
within the time limit, never a hang; `posttrain rl` trains on the per-turn rewards, and a server killed mid-run
fails only the trajectories it held, one error each, while the run goes on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from posttrain.agent.env_openenv import OpenEnvConfig, OpenEnvError, OpenEnvSession, observation_text, ws_url
from posttrain.agent.setup import load_agent_parts
from posttrain.config import ConfigError
from posttrain.rl.config import RolloutConfig

REPO = Path(__file__).resolve().parents[1]
ECHO = REPO / "tests" / "openenv_echo.py"
# the tiny model's character tokenizer: <eos> and the lower-case letters end a turn, so turns are a few characters
# and nearly every one ends with a stop (a `step`), not at max_new_tokens
STOPS = [2] + list(range(74, 100))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EchoServer:
    """`tests/openenv_echo.py` in a process of its own: `url`, its session log (`opened`, `closed`, `steps`)."""

    def __init__(self, folder: Path, slow: float = 0.0):
        self.port, self.log = _free_port(), folder / f"sessions-{time.monotonic_ns()}.log"
        self.log.touch()
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen([sys.executable, str(ECHO), str(self.port), str(self.log), "--slow", str(slow)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise TimeoutError("the echo server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lines(self, kind: str) -> list[str]:
        return [line.split()[1] for line in self.log.read_text().splitlines() if line.startswith(kind + " ")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    server = EchoServer(tmp_path_factory.mktemp("openenv"))
    yield server
    server.stop()


class _Session(OpenEnvSession):
    """An `OpenEnvSession` whose calls take one time limit."""

    def __init__(self, url: str, timeout: float, cfg: OpenEnvConfig):
        super().__init__(ws_url(url), cfg)
        self.timeout = timeout

    def reset(self, record, timeout=None):
        return super().reset(record, self.timeout)

    def step(self, text, timeout=None):
        return super().step(text, self.timeout)


def _session(url: str, timeout: float = 5.0, **cfg) -> _Session:
    return _Session(url, timeout, OpenEnvConfig(**cfg))


def _wait_closed(server: EchoServer, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(server.lines("close")) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def test_urls_and_observation_text():
    assert ws_url("http://h:1") == ws_url("ws://h:1/") == ws_url("h:1") == "ws://h:1/ws"
    assert ws_url("https://h/env") == "wss://h/env/ws" and ws_url("ws://h:1/ws") == "ws://h:1/ws"
    assert observation_text({"text": "hi", "n": 3}) == "hi"
    assert observation_text({"echo": "only string"}) == "only string"
    assert observation_text({"prompt": "p", "message": "m"}) == "m"
    assert observation_text({"board": [1, 2], "n": 3}) == '{"board": [1, 2], "n": 3}'
    assert observation_text({"a": "x", "b": [1]}, "b") == "[1]"
    with pytest.raises(KeyError, match=r"no field 'c'.*\['a', 'b'\]"):
        observation_text({"a": "x", "b": 1}, "c")


def test_one_session_plays_a_game_and_closes(echo):
    before = len(echo.lines("open"))
    s = _session(echo.url)
    assert s.reset({"seed": 7, "prompt": "unused", "image": object()}) == [
        {"role": "user", "content": "Say something (game 7)."}]
    assert s.step("hello") == ("You said: hello", pytest.approx(0.5), False)
    assert s.step("hi there") == (None, pytest.approx(0.8), True)  # done: the session closes itself
    assert s.closed
    _wait_closed(echo, before + 1)
    opened = echo.lines("open")[before:]
    assert len(opened) == 1 and echo.lines("close")[-1] == opened[0]


def test_an_unknown_action_field_or_observation_field_is_one_error(echo):
    s = _session(echo.url, action_field="msg")
    s.reset({})
    with pytest.raises(OpenEnvError, match=r"^step: server error VALIDATION_ERROR"):
        s.step("x")
    assert s.closed
    s = _session(echo.url, observation_field="board")
    with pytest.raises(OpenEnvError, match=r"^reset: the observation has no field 'board'.*\['text'\]"):
        s.reset({})


class _BadServer:
    """A WebSocket server (the `websockets` package) that misbehaves as `mode` says: `silent` (never answers),
    `garbage` (answers non-JSON), `wrong` (answers JSON that is not an observation), `hangup` (closes the
    connection at the first message)."""

    def __init__(self, mode: str):
        from websockets.sync.server import serve

        def handler(ws):
            for raw in ws:
                if mode == "silent":
                    time.sleep(30)
                elif mode == "garbage":
                    ws.send("<html>oops</html>")
                elif mode == "wrong":
                    ws.send(json.dumps({"type": "state", "data": {}}))
                elif mode == "hangup":
                    ws.close()
                    return

        self.server = serve(handler, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.socket.getsockname()[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.mark.parametrize("mode,match", [
    ("silent", r"^reset: no answer within 1s$"),
    ("garbage", r"^reset: the answer is not JSON: '<html>oops</html>'"),
    ("wrong", r"^reset: expected an observation answer"),
    ("hangup", r"^reset: the server closed the session"),
])
def test_a_misbehaving_server_is_one_error_within_the_limit(mode, match):
    bad = _BadServer(mode)
    try:
        s = _session(bad.url, timeout=1.0)
        t = time.monotonic()
        with pytest.raises(OpenEnvError, match=match) as e:
            s.reset({})
        assert time.monotonic() - t < 3.0 and "\n" not in str(e.value) and s.closed
    finally:
        bad.close()


def test_a_server_that_is_down_or_never_accepts_is_one_error():
    port = _free_port()
    t = time.monotonic()
    with pytest.raises(OpenEnvError, match=r"^cannot connect \(ConnectionRefusedError"):
        _session(f"http://127.0.0.1:{port}").reset({})
    with socket.socket() as listener:  # accepts TCP connections (backlog) but never answers the handshake
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        with pytest.raises(OpenEnvError, match=r"^no connection within 1s"):
            _session(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=1.0).reset({})
    assert time.monotonic() - t < 5.0


def test_through_the_environment_protocol_failures_are_counted_and_close(echo):
    """The run's `EnvSession` over an OpenEnv backend: per-turn rewards recorded; a reset past the time limit is
    one `reset timeout` failure naming the URL, within the limit, and the session is closed at once; a server that
    hangs up mid-game is one `step exception`."""
    rollout = RolloutConfig(environment=f"openenv:{echo.url}", tool_timeout_s=5.0)
    _, spec = load_agent_parts(rollout)
    assert spec.has_step and not spec.has_reward and spec.name == f"OpenEnv[ws://127.0.0.1:{echo.port}/ws]"
    session = spec.make(5.0)
    assert session.reset({"seed": 1})[0]["content"] == "Say something (game 1)."
    assert session.step("abc").reward == pytest.approx(0.3)
    assert session.step("abcd").done and session.turn_rewards == pytest.approx([0.3, 0.4])
    session.close()
    silent = _BadServer("silent")
    try:
        _, spec = load_agent_parts(RolloutConfig(environment=f"openenv:{silent.url}", tool_timeout_s=1.0))
        session = spec.make(1.0)
        t = time.monotonic()
        with pytest.raises(Exception) as e:
            session.reset({})
        assert time.monotonic() - t < 1.8
        assert session.failure.label == "reset timeout" and "OpenEnv[ws://127.0.0.1:" in session.failure.text
        assert "its session was closed" in session.failure.text and "\n" not in str(e.value)
        assert session.backend is None  # closed by the time-out
    finally:
        silent.close()
    hangup = _BadServer("hangup")
    try:
        _, spec = load_agent_parts(RolloutConfig(environment=f"openenv:{hangup.url}", tool_timeout_s=2.0))
        session = spec.make(2.0)
        with pytest.raises(Exception):
            session.reset({})
        assert session.failure.label == "reset exception" and "the server closed the session" in session.failure.text
    finally:
        hangup.close()


def test_bad_references_are_config_errors():
    for ref in ("openenv:", "openenv: http://a b"):
        with pytest.raises(ConfigError, match="rollout.environment: .* must be openenv:URL"):
            load_agent_parts(RolloutConfig(environment=ref))
    with pytest.raises(ValueError, match="rollout.openenv.action_field"):
        OpenEnvConfig(action_field="")


def _rl(tmp_path: Path, url: str, steps: int, *extra: str, wait: bool = True):
    (tmp_path / "games.jsonl").write_text("".join(json.dumps({"seed": i}) + "\n" for i in range(6)))
    cmd = [sys.executable, "-m", "posttrain.cli.main", "rl", str(REPO / "configs/rl_smoke.yaml"),
           f"output_dir={tmp_path / 'out'}", f"trainer.max_steps={steps}", "trainer.save_every=0",
           "eval.at_start=false", "data.train=games.jsonl", "data.eval=null", "rollout.max_turns=3",
           f"rollout.environment=openenv:{url}", "rewards.functions=[]", "rewards.correctness=environment",
           "eval.log_samples=64", f"rollout.stop_token_ids={STOPS}", *extra]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc if not wait else (proc.communicate(timeout=900)[0], proc.returncode)


def _trajectories(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out/trajectories.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rl_trains_on_the_per_turn_rewards_one_session_per_trajectory(echo, tmp_path):
    before = len(echo.lines("open"))
    out, code = _rl(tmp_path, echo.url, 2)
    assert code == 0, out[-3000:]
    rows = _trajectories(tmp_path)
    assert len(rows) == 2 * 4 * 4  # every trajectory of the 2 steps (4 prompts x 4 samples)
    steps = 0
    for row in rows:
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert row["turn_rewards"] == pytest.approx([0.1 * len(r) for r in replies[:len(row["turn_rewards"])]])
        assert row["reward"] == pytest.approx(sum(row["turn_rewards"]))
        steps += len(row["turn_rewards"])
    assert steps > len(rows)  # most games went 2 steps
    _wait_closed(echo, before + 1 + len(rows))
    opened, closed = echo.lines("open")[before:], echo.lines("close")
    # one session per trajectory, plus the one the prompts were encoded through at the start (reset per record)
    assert len(opened) == len(rows) + 1 and set(opened) <= set(closed)
    assert len(echo.lines("step")) >= steps


@pytest.mark.slow
def test_a_server_killed_mid_run_fails_the_trajectories_it_held(tmp_path):
    server = EchoServer(tmp_path, slow=0.05)
    try:
        proc = _rl(tmp_path, server.url, 2, "rollout.max_env_error_fraction=1.0", "rollout.tool_timeout_s=5",
                   wait=False)
        deadline = time.monotonic() + 600
        while len(server.lines("step")) < 8 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        server.stop()  # mid step 1: some games are half played
        out, _ = proc.communicate(timeout=600)
    finally:
        server.stop()
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    rows = _trajectories(tmp_path)
    failed = [r for r in rows if r["env_errors"]]
    url = f"OpenEnv[ws://127.0.0.1:{server.port}/ws]"
    assert failed and all(url in r["env_error"] and r["finish_reason"] == "env_error" for r in failed)
    assert all(r["env_errors"] == 1 and "\n" not in r["env_error"] for r in failed)  # one error line each
    assert any(r.get("env_error_kind") == "step exception" for r in failed if r["step"] == 1)  # cut mid-game
    second = [r for r in rows if r["step"] == 2]
    assert second and all(r["env_errors"] for r in second)  # the server is gone for all of step 2
    metrics = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["agent/env_errors"] == 1.0
    assert sum("warning: environment OpenEnv[" in line for line in out.splitlines()) <= 2  # one per kind


@pytest.mark.slow
def test_eval_plays_the_server_and_reports_its_rewards(echo, tmp_path):
    """`posttrain eval --environment openenv:URL --reward environment`: every problem's greedy and sampled
    trajectories play the server, the first user turn is its reset observation, the reward is the sum of the
    per-turn rewards, and every session is closed."""
    (tmp_path / "games.jsonl").write_text("".join(json.dumps({"seed": i}) + "\n" for i in range(3)))
    before = len(echo.lines("open"))
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "eval", "--model", "tiny:llama", "--data",
                          "games.jsonl", "--environment", f"openenv:{echo.url}", "--openenv-action-field", "message",
                          "--reward", "environment", "--max-turns", "3", "--max-new-tokens", "4", "--n", "2",
                          "--output", "ev.jsonl", "--no-progress"], cwd=tmp_path, env=env, text=True, check=False,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "ev.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for i, row in enumerate(rows):
        traj = row["greedy"]["trajectory"]
        assert traj["messages"][0] == {"role": "user", "content": f"Say something (game {i})."}
        assert row["greedy"]["reward"] == pytest.approx(sum(traj["turn_rewards"]))
    _wait_closed(echo, before + 1 + 3 * (1 + 2))
    opened = echo.lines("open")[before:]
    assert len(opened) == 1 + 3 * (1 + 2) and set(opened) <= set(echo.lines("close"))  # encoding, greedy, 2 samples


@pytest.mark.slow
def test_fleet_workers_play_the_server(echo, tmp_path, compile_cache):
    """On the Ray fleet each rollout worker's own agent opens the sessions: the same per-turn rewards, every
    session closed."""
    before = len(echo.lines("open"))
    out, code = _rl(tmp_path, echo.url, 1, "fleet.workers=1", "fleet.max_staleness=0", "fleet.stall_timeout_s=300")
    assert code == 0, out[-3000:]
    rows = _trajectories(tmp_path)
    assert len(rows) == 16 and sum(len(r["turn_rewards"]) for r in rows) > 16
    for row in rows:
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert row["turn_rewards"] == pytest.approx([0.1 * len(r) for r in replies[:len(row["turn_rewards"])]])
    _wait_closed(echo, before + 1 + 16)
    opened = echo.lines("open")[before:]
    assert len(opened) == 16 + 1 and set(opened) <= set(echo.lines("close"))
