"""The python tool's remote backend: post the snippet to an HTTP sandbox service speaking SandboxFusion's API.

`RemoteSandbox(url, ...)` (`rollout.sandbox.backend: remote`, `rollout.sandbox.url`) sends
`POST {url}/run_code` with `{"code", "language": "python", "run_timeout", "memory_limit_MB"}` and reads
`{"status", "message", "run_result": {"status", "return_code", "stdout", "stderr"}}` (the service verl and SkyRL
use for model-written code on clusters). Each request has a time limit (the run's wall limit plus
`request_timeout_s` of slack); connection errors, time-outs and 5xx answers are retried `retries` times with a
short back-off; at most `max_concurrency` requests are in flight from one process. Returns a `JailResult`-shaped
`(returncode, timed_out, stdout, stderr)`; a service that cannot be reached is a `RemoteSandboxError`.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

__all__ = ["RemoteSandbox", "RemoteSandboxError"]


class RemoteSandboxError(RuntimeError):
    """The sandbox service could not run the snippet (unreachable, refused, or answered nonsense)."""


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
        answer = self._post(body, timeout=limits.wall_s + self.request_timeout_s)
        run = answer.get("run_result") or {}
        if answer.get("status") == "SandboxError" or not isinstance(run, dict):
            raise RemoteSandboxError(f"the sandbox service failed: {answer.get('message') or answer}")
        timed_out = run.get("status") == "TimeLimitExceeded"
        code_ = run.get("return_code")
        code_ = code_ if isinstance(code_, int) else (0 if answer.get("status") == "Success" else 1)
        out = str(run.get("stdout") or "").encode()[: max_output_bytes + 1]
        err = str(run.get("stderr") or "").encode()[: max_output_bytes + 1]
        return code_, timed_out, out, err

    def _post(self, body: dict, timeout: float) -> dict:
        data = json.dumps(body).encode()
        last = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(2.0, 0.2 * 2 ** attempt))
            request = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
            try:
                with self._slots, urllib.request.urlopen(request, timeout=timeout) as response:
                    return json.loads(response.read().decode())
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
