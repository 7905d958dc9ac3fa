"""The built-in `python` tool: run a snippet of model-written Python in a sandbox and return what it printed.

Model-written code is hostile by assumption. `SandboxConfig.backend` (`rollout.sandbox.backend`) chooses where
it runs:
- `namespaces` (default): the kernel's boundary on this machine (`posttrain.tools.jail`: fresh user, PID,
  mount, network and IPC namespaces, read-only system and Python folders, a private tmpfs, no network, an
  unprivileged uid, `no_new_privs`, rlimits and cgroup limits, the whole process tree killed after each call);
- `remote`: an HTTP sandbox service speaking SandboxFusion's API at `url` (`posttrain.tools.remote_sandbox`);
- `process`: a plain process with rlimits and an audit hook (`posttrain.tools.process_sandbox`): NOT a boundary,
  for machines without user namespaces, chosen explicitly; a warning says so at start.
There is no silent downgrade: `check_sandbox(config)` (called when a run with the python tool starts) raises a
one-line `SandboxUnavailable` when the chosen backend cannot run here (no user namespaces, no seccomp), saying what
to enable; `run_python` of an unavailable backend answers an `Error:` line and runs nothing. Where cgroups cannot
be written it says so once (a call's memory is then bounded per process only: `memory_mb` x `max_processes`,
and no CPU quota holds).

Time: a call's own limit (`wall_s`) ends before the limit of whoever waits for it, so the sandbox always cleans up
after itself: `SandboxConfig.call_limit_s` (wall time plus the sandbox's start-up and clean-up slack, or for the
remote backend every attempt's time limit and back-off) is the tool pool's limit for the python tool, derived,
not a second number to keep in step. A worker killed anyway (an environment method past its own limit while it
ran a snippet) leaves a folder and cgroup named after it, which `sweep_leftovers()` removes when the next worker
starts.

Each process uses one sandbox setting: `use_sandbox(config)` sets it (the tool worker pool does so in its
workers); without it, the defaults hold. Every outcome comes back as text, never as an exception.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import Literal

from posttrain.tools.cgroups import cgroup_controllers, sweep_stale_groups
from posttrain.tools.jail import START_SLACK_S, JailError, jail_support, run_jailed
from posttrain.tools.limits import PythonLimits
from posttrain.tools.process_sandbox import run_in_process
from posttrain.tools.remote_sandbox import RemoteSandbox, RemoteSandboxError
from posttrain.tools.scratch import sweep_stale_folders

__all__ = ["PythonLimits", "SandboxConfig", "SandboxUnavailable", "check_sandbox", "python", "run_python",
           "sweep_leftovers", "use_sandbox"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SandboxConfig(PythonLimits):
    """Where the built-in `python` tool runs model-written code (`rollout.sandbox`), and its limits per call: the
    keys of `PythonLimits` (`posttrain.tools.limits`), whose defaults they keep.

    backend: `namespaces` (the kernel's sandbox on this machine; needs Linux user namespaces), `remote` (an
      HTTP service speaking SandboxFusion's `/run_code` API at `url`) or `process` (rlimits and an audit hook
      only: not a security boundary; opt in where user namespaces are off).
    url: the remote service's base address (e.g. http://127.0.0.1:8080); required with backend remote.
    request_timeout_s: remote: seconds of slack past the run's wall limit per request.
    retries: remote: retries after a connection error, time-out or 5xx answer (short back-off).
    max_concurrency: remote: requests in flight at once from one process, at most.

    The remote service gets only `wall_s` and `memory_mb`; the process backend all but `max_processes`, `work_mb`
    and `cpus`.
    """
    backend: Literal["namespaces", "remote", "process"] = "namespaces"
    url: str | None = None
    request_timeout_s: float = 30.0
    retries: int = 2
    max_concurrency: int = 8

    def __post_init__(self):
        super().__post_init__()
        if self.backend == "remote" and not self.url:
            raise ValueError("rollout.sandbox.url is required with rollout.sandbox.backend: remote "
                             "(the SandboxFusion service's base address, e.g. http://127.0.0.1:8080)")
        for key in ("request_timeout_s", "max_concurrency"):
            if not getattr(self, key) > 0:
                raise ValueError(f"rollout.sandbox.{key} must be > 0, found {getattr(self, key)}")
        if self.retries < 0:
            raise ValueError(f"rollout.sandbox.retries must be >= 0, found {self.retries}")

    @property
    def call_limit_s(self) -> float:
        """The most one python tool call can take, its sandbox's own start-up, retries and clean-up included: the
        tool pool's time limit for it (longer than `wall_s`, so the sandbox's limit always fires first)."""
        if self.backend == "remote":
            attempts = self.retries + 1
            backoff = sum(min(2.0, 0.2 * 2 ** a) for a in range(1, attempts))
            return attempts * (self.wall_s + self.request_timeout_s) + backoff + 1.0
        return self.wall_s + START_SLACK_S


class SandboxUnavailable(RuntimeError):
    """The chosen backend cannot run on this machine (the message says what to enable or choose)."""


_CONFIG = SandboxConfig()


def use_sandbox(config: SandboxConfig) -> None:
    """Make `config` this process's sandbox setting (the tool pool calls this in each worker)."""
    global _CONFIG
    _CONFIG = config


def sweep_leftovers() -> None:
    """Remove the host folders and cgroups of calls whose worker was killed mid-call (their makers are gone):
    run when a tool or environment worker starts."""
    sweep_stale_folders()
    sweep_stale_groups()


def _enable_hint(why: str) -> str:
    if "seccomp" in why:
        return ("install the system's libseccomp (Debian/Ubuntu: apt-get install libseccomp2; RHEL: dnf install "
                "libseccomp) and the pyseccomp package")
    return ("enable unprivileged user namespaces (sysctl user.max_user_namespaces=15000, and "
            "kernel.unprivileged_userns_clone=1 or kernel.apparmor_restrict_unprivileged_userns=0 where those "
            "exist)")


def no_cgroup_note(config: SandboxConfig) -> str | None:
    """What a call is not limited by on this machine for want of writable cgroups (None: nothing missing)."""
    have = cgroup_controllers()
    if {"memory", "pids", "cpu"} <= set(have):
        return None
    if not have:
        bound = config.memory_mb * config.max_processes
        return (f"cgroups cannot be written here, so a python tool call's memory is bounded per process only "
                f"({config.memory_mb} MiB address space x {config.max_processes} processes = {bound / 1024:g} GiB "
                f"a call, times the calls running at once) and no CPU quota holds (only {config.cpu_s} s of CPU "
                "per process); give the run a delegated cgroup (memory, pids and cpu controllers) to limit each "
                f"call to {config.memory_mb} MiB and {config.cpus:g} cores")
    return (f"the cgroup's cpu controller is not delegated here, so a python tool call has no CPU quota "
            f"(rollout.sandbox.cpus={config.cpus:g} does not apply; only {config.cpu_s} s of CPU per process)")


_NOTED: set[str] = set()


def check_sandbox(config: SandboxConfig) -> None:
    """Raise `SandboxUnavailable` (one line) when `config.backend` cannot run here; warn once for `process`, and
    once where cgroups cannot limit a call."""
    if config.backend == "process":
        logger.warning("rollout.sandbox.backend is 'process': model-written code runs as this run's user with "
                       "rlimits and an audit hook only, which a snippet can turn off; this is not a sandbox")
    elif config.backend == "namespaces":
        why = jail_support()
        if why is not None:
            raise SandboxUnavailable(
                f"the python tool's sandbox cannot start here ({why}): {_enable_hint(why)}, or set "
                "rollout.sandbox.backend=remote with rollout.sandbox.url, or accept the unsafe "
                "rollout.sandbox.backend=process")
        note = no_cgroup_note(config)
        if note is not None and note not in _NOTED:
            _NOTED.add(note)
            logger.warning(note)


def _status(code: int, timed_out: bool, limits: PythonLimits) -> str | None:
    if timed_out:
        return f"Error: the code ran past the {limits.wall_s:g}s time limit and was stopped"
    if code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return f"Error: the code used more than {limits.cpu_s}s of CPU time or its memory limit and was stopped"
    if code == 128 + signal.SIGXFSZ:
        return f"Error: the code wrote more than {limits.file_bytes} bytes (output or file) and was stopped"
    if code > 128 and code - 128 in signal.valid_signals():
        return f"Error: the process ended with signal {signal.Signals(code - 128).name}"
    if code != 0:
        return f"Error: the code exited with status {code}"
    return None


def _text(data: bytes, max_bytes: int) -> str:
    text = data[:max_bytes].decode("utf-8", errors="replace")
    return text + "\n[... output cut: more bytes not shown]" if len(data) > max_bytes else text


def _run(code: str, config: SandboxConfig, limits: PythonLimits) -> tuple[int, bool, bytes, bytes]:
    if config.backend == "remote":
        return RemoteSandbox(config.url, request_timeout_s=config.request_timeout_s, retries=config.retries,
                             max_concurrency=config.max_concurrency).run(code, limits, limits.max_output_bytes)
    if config.backend == "process":
        return run_in_process(code, limits, limits.max_output_bytes)
    why = jail_support()
    if why is not None:
        raise SandboxUnavailable(why)
    r = run_jailed(code, limits, limits.max_output_bytes)
    return r.returncode, r.timed_out, r.stdout, r.stderr


def run_python(code: str, limits: PythonLimits | None = None, config: SandboxConfig | None = None) -> str:
    """stdout of `code` (then its stderr, marked), or an `Error: ...` line followed by what it printed."""
    if not isinstance(code, str):
        return f"Error: code must be a string, got {type(code).__name__}"
    config = config or _CONFIG
    limits = limits or config  # the section is its own limits
    try:
        returncode, timed_out, out, err = _run(code, config, limits)
    except (SandboxUnavailable, JailError, RemoteSandboxError) as e:
        return f"Error: the sandbox could not run the code: {e}"
    status = _status(returncode, timed_out, limits)
    stdout, stderr = _text(out, limits.max_output_bytes), _text(err, limits.max_output_bytes)
    parts = [p for p in (status, stdout.rstrip("\n"), stderr and "[stderr]\n" + stderr.rstrip("\n")) if p]
    return "\n".join(parts) if parts else "(no output)"


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints (stdout, then stderr).

    Args:
        code: a Python program; print the values you want to see
    """
    return run_python(code)
