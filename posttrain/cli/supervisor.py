"""The `posttrain` command's supervision of a multi-process run: a process's death is always one line of ours.

In a multi-host run JAX's coordination service ends a process natively (SIGABRT, "Terminating process because
the JAX distributed service detected fatal errors" and a C++ stack trace) when it learns that another process
died; when the dead one is the coordinator (process 0) it does so at once, before our watchdog
(`posttrain.distributed.Watchdog`) can say anything. So when a command's run has several processes,
`distributed.initialize` hands over to `supervise` (registered by `posttrain.cli.main`), which runs the same
command again as a child process (marked by `POSTTRAIN_SUPERVISED`) and stays beside it:

- the child's stdout is the command's own; its stderr passes through line by line, except what JAX's distributed
  runtime writes there (its log lines, the abort and the stack trace after them), which is held back;
- SIGINT, SIGTERM and SIGHUP are forwarded to the child (in its own session, so that a terminal's Ctrl-C or a
  signal to the process group reaches it once, through here); the child dies with this process (PDEATHSIG);
- when the child dies by a signal, the command prints one line `error: multi-host run: ...` naming the process
  JAX reported dead (or how the child ended) and exits 1; otherwise it exits with the child's status.

A one-process run never gets here: no extra process, no extra start-up.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

ENV_SUPERVISED = "POSTTRAIN_SUPERVISED"  # set (to the supervisor's pid) in the child's environment
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# absl log lines ("E1125 14:39:46.596427  8838 file.cc:289] ...") from JAX's distributed runtime
_RUNTIME_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ (coordination\S*|client\.(h|cc)|preemption\S*|service\.cc|"
                           r"distributed\S*|grpc\S*):\d+\]")
_LOG_HEADER = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]")  # any absl line's start
_ADOPTED = {"child": False}


def adopt() -> bool:
    """In the child (called first thing by the command): whether this process is a supervised child. It takes the
    marker out of the environment (processes it starts are not children of a supervisor) and arranges to die
    with the supervisor."""
    parent = os.environ.pop(ENV_SUPERVISED, None)
    if parent is None:
        return False
    _ADOPTED["child"] = True
    if sys.platform.startswith("linux"):
        import ctypes

        try:  # PR_SET_PDEATHSIG: SIGKILL when the supervisor dies (a host's death kills both)
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the supervisor's end is not seen
            pass
    if str(os.getppid()) != parent:  # the supervisor died before the line above
        os._exit(1)
    return True


def is_child() -> bool:
    return _ADOPTED["child"]


class StderrRelay:
    """Copies the child's stderr to ours, line by line, holding back JAX's distributed-runtime output from its
    first line on (only our own `error: ...`/`posttrain: ...` lines still pass); `POSTTRAIN_DEBUG=1` holds nothing."""

    def __init__(self, stream, out, debug: bool):
        self.stream, self.out, self.debug = stream, out, debug
        self.held: list[bytes] = []
        self.holding = False
        self.verdict = False  # our own multi-host error line came through

    def run(self) -> None:
        for line in iter(self.stream.readline, b""):
            self.take(line)

    def take(self, line: bytes) -> None:
        text = line.decode(errors="replace")
        ours = text.startswith(("error: ", "posttrain: ")) and not self.verdict
        if ours and (glued := _LOG_HEADER.search(text, 7)):  # the runtime's log line written onto the end of ours
            self.take(text[: glued.start()].encode() + b"\n")
            self.holding = True
            self.held.append(text[glued.start():].encode())
            return
        # after our verdict line the process is ending: whatever the runtime still writes is held back
        if self.verdict or (not ours and (_RUNTIME_LINE.match(text) or "Terminating process because" in text)):
            self.holding = True
        self.verdict = self.verdict or (ours and text.startswith("error: multi-host run:"))
        if self.debug or ours or not self.holding:
            self.write(line)
        else:
            self.held.append(line)

    def write(self, data: bytes) -> None:
        try:
            self.out.write(data)
            self.out.flush()
        except (OSError, ValueError):  # our stderr is gone: nothing to tell
            pass

    def held_text(self) -> str:
        return b"".join(self.held).decode(errors="replace")


def what_jax_reported(text: str, me: int | None, n: int | None = None) -> str | None:
    """Which process JAX's distributed service reported dead, in our words, from the child's held-back stderr
    (None when the text holds no such report)."""
    if "Terminating process because" not in text and "coordination" not in text:
        return None
    m = re.search(r"unhealthy[^\n]*:\s*\n(.*?)(?:\n\s*The tasks|\Z)", text, re.S)
    ids = sorted({int(i) for i in re.findall(r"(?:task:|^\s*)(\d+)\s*$", m.group(1), re.M)}) if m else []
    if ids:
        of = f" of {n}" if n else ""
        return " and ".join(f"process {i}" for i in ids) + f"{of} stopped answering"
    if me != 0:
        return "the coordinator (process 0) stopped answering"
    return "another process stopped answering"


def outcome(code: int, relay: StderrRelay, settings: dict) -> int:
    """The command's exit status for the child's `code` (a Popen returncode), after printing what to say."""
    if code >= 0 or relay.verdict:  # the child ended itself (its own words came through) or our line is out
        if not relay.verdict:
            relay.write(b"".join(relay.held))
        return code if code >= 0 else 1
    from posttrain.distributed import peer_lost_message

    try:
        how = signal.Signals(-code).name
    except ValueError:
        how = f"signal {-code}"
    me, n = settings.get("process_id"), settings.get("num_processes")
    what = what_jax_reported(relay.held_text(), me, n)
    if what is not None:
        line = peer_lost_message(f"{what} (JAX's distributed service reported it and ended this process)", me)
    else:
        relay.write(b"".join(relay.held))
        who = f"process {me} of {n}" if me is not None else "this process"
        line = peer_lost_message(f"the work of {who} ended by {how}", None)
    relay.write(line.encode() + b"\n")
    return 1


def supervise(settings: dict):
    """Runs this command again as a supervised child and ends this process with its outcome (never returns)."""
    sys.stdout.flush()
    sys.stderr.flush()
    env = dict(os.environ, **{ENV_SUPERVISED: str(os.getpid())})
    child = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", *sys.argv[1:]], env=env,
                             stderr=subprocess.PIPE, start_new_session=True)
    for s in _FORWARDED:
        signal.signal(s, lambda signum, frame: child.send_signal(signum))
    debug = os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0")
    relay = StderrRelay(child.stderr, sys.stderr.buffer, debug)
    reader = threading.Thread(target=relay.run, name="posttrain-stderr-relay", daemon=True)
    reader.start()
    code = child.wait()
    reader.join(timeout=5)  # the rest of its stderr (a process it started may still hold the pipe open)
    code = outcome(code, relay, settings)
    sys.stdout.flush()
    os._exit(code)
