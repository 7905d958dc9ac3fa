"""`posttrain serve` as a user starts it: the start-up line says where it listens, the API key comes from the
environment, one log line per request, bad flags are one line, and SIGTERM lets a streamed answer in flight finish
before the process exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import openai
import pytest

pytestmark = pytest.mark.slow  # a process of its own: start-up, compiles, shutdown


@pytest.fixture(scope="module")
def server(tmp_path_factory, compile_cache):
    env = {**os.environ, **compile_cache, "POSTTRAIN_API_KEY": "sk-cli",
           "POSTTRAIN_CACHE": str(tmp_path_factory.mktemp("tiny"))}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "serve", "tiny:llama", "--port", "0",
                             "--max-slots", "4", "--segment-steps", "4"], env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"on (http://[\d.]+:\d+)", line)
        if m:
            break
    assert m, "".join(lines)
    yield {"proc": proc, "url": m.group(1), "lines": lines}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigterm_finishes_the_stream_in_flight_then_exits_0(server):
    proc = server["proc"]
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="sk-cli", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["url"] + "/v1", api_key="nope", max_retries=0).models.list()
    assert client.models.list().data[0].id == "tiny:llama"
    stream = client.completions.create(model="tiny:llama", prompt="abc", max_tokens=300, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    text, sent = "", False
    for chunk in stream:
        text += chunk.choices[0].text if chunk.choices else ""
        if not sent and text:
            proc.send_signal(signal.SIGTERM)
            sent = True
    assert sent
    whole_len = len(text)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, rest
    assert "posttrain serve: stopped" in rest
    log = [line for line in server["lines"] + rest.splitlines() if '"' in line]
    assert [re.search(r'"(\w+ \S+)" (\d+)', line).groups() for line in log] == [
        ("GET /v1/models", "401"), ("GET /v1/models", "200"), ("POST /v1/completions", "200")]
    assert "completion_tokens=" in log[-1] and whole_len > 0


def test_bad_flags_are_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "serve", "tiny:llama", "--lora", "oops"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: --lora 'oops': expected NAME=PATH (a LoRA run's output folder or a PEFT adapter folder)"]
