"""The python tool's remote backend: post the snippet to an HTTP sandbox service speaking SandboxFusion's API.

`RemoteSandbox(url, ...)` (`rollout.sandbox.backend: remote`, `rollout.sandbox.url`) sends
`POST {url}/run_code` with `{"code", "language": "python", "run_timeout", "memory_limit_MB"}` and reads
`{"status", "message", "run_result": {"status", "return_code", "stdout", "stderr"}}` (the service verl and SkyRL
use for model-written code on clusters). Each request has a time limit (the run's wall limit plus
`request_timeout_s` of slack); connection errors, time-outs and 5xx answers are retried `retries` times with a
short back-off; at most `max_concurrency` requests are in flight from one process. Returns a `JailResult`-shaped
`(returncode, timed_out, stdout, stderr)`; a service that cannot be reached is a `RemoteSandboxError`.

The answer is read only up to `answer_limit(max_output_bytes)`: the output kept (stdout and stderr, each JSON
escaped at worst 6 bytes a byte) plus the envelope. A longer answer (a declared length past it, or more bytes
than that arriving) is a `RemoteSandboxError` (the tool answers an `Error:` line), not retried, and never held in
memory whole.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

__all__ = ["RemoteSandbox", "RemoteSandboxError", "answer_limit"]

ENVELOPE_BYTES = 64 << 10  # status, message, return code, timings, ... of one answer


def answer_limit(max_output_bytes: int) -> int:
    """Bytes of a service's answer read at most: stdout and stderr cut to `max_output_bytes` each (then marked
    cut), JSON escaping (6 bytes at worst per byte), and the envelope."""
    return 2 * 6 * (max_output_bytes + 1) + ENVELOPE_BYTES


class RemoteSandboxError(RuntimeError):
    """The sandbox service could not run the snippet (unreachable, refused, or answered nonsense)."""


class _TooLarge(ValueError):
    """The service's answer is longer than the client reads."""


_SEMAPHORES: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_SEMAPHORES_LOCK = threading.Lock()


def _semaphore(url: str, n: int) -> threading.BoundedSemaphore:
    with _SEMAPHORES_LOCK:
        return _SEMAPHORES.setdefault((url, n), threading.BoundedSemaphore(n))


class RemoteSandbox:
    """A client of one SandboxFusion-style service (see the module docstring)."""

    def __init__(self, url: str, *, request_timeout_s: float = 30.0, retries: int = 2, max_concurrency: int = 8):
        self.url = url.rstrip("/") + "/run_code"
        self.request_timeout_s, self.retries = request_timeout_s, retries
        self._slots = _semaphore(self.url, max_concurrency)

    def run(self, code: str, limits, max_output_bytes: int) -> tuple[int, bool, bytes, bytes]:
        body = {"code": code, "language": "python", "run_timeout": limits.wall_s,
                "memory_limit_MB": max(1, limits.memory_bytes >> 20)}
        answer = self._post(body, timeout=limits.wall_s + self.request_timeout_s,
                            max_bytes=answer_limit(max_output_bytes))
        run = answer.get("run_result") or {}
        if answer.get("status") == "SandboxError" or not isinstance(run, dict):
            raise RemoteSandboxError(f"the sandbox service failed: {answer.get('message') or answer}")
        timed_out = run.get("status") == "TimeLimitExceeded"
        code_ = run.get("return_code")
        code_ = code_ if isinstance(code_, int) else (0 if answer.get("status") == "Success" else 1)
        out = str(run.get("stdout") or "").encode()[: max_output_bytes + 1]
        err = str(run.get("stderr") or "").encode()[: max_output_bytes + 1]
        return code_, timed_out, out, err

    def _post(self, body: dict, timeout: float, max_bytes: int) -> dict:
        data = json.dumps(body).encode()
        last = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(2.0, 0.2 * 2 ** attempt))
            request = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
            try:
                with self._slots, urllib.request.urlopen(request, timeout=timeout) as response:
                    return json.loads(_read_bounded(response, max_bytes).decode())
            except _TooLarge as e:
                last = f"{self.url} answered {e}"
                break
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} from {self.url}"
                if e.code < 500:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{self.url}: {getattr(e, 'reason', e)}"
            except ValueError as e:
                last = f"{self.url} answered something that is not JSON: {e}"
                break
        raise RemoteSandboxError(f"the sandbox service did not run the code ({last}; {attempt + 1} attempt(s))")


def _read_bounded(response, max_bytes: int) -> bytes:
    """The body, if it is at most `max_bytes` long; else `_TooLarge` (after reading at most one byte more)."""
    declared = response.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _TooLarge(f"{int(declared)} bytes (declared), more than the {max_bytes} bytes this client reads "
                        "(rollout.sandbox: the output kept plus the envelope)")
    data = response.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _TooLarge(f"more than the {max_bytes} bytes this client reads "
                        "(rollout.sandbox: the output kept plus the envelope)")
    return data
