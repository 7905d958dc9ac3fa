"""Connecting to Ray: a local instance started for the run, or a running cluster (`ray start`), with clear errors.

A local instance (no `fleet.ray_address`) belongs to the run: `ray.shutdown()` stops it at the end, and a
small reaper process removes what Ray leaves behind when the trainer is killed outright (SIGKILL: Ray's
raylet follows its driver, but its per-node agents do not). A cluster address is checked with a plain TCP
connection first, so an unreachable head is an error within `fleet.connect_timeout_s`, not a hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings

from posttrain.rl.errors import FleetError

__all__ = ["FleetError", "require_ray", "connect", "join", "disconnect"]


def require_ray():
    try:
        import ray  # lazy: this module imports without Ray; a missing Ray becomes a FleetError
    except ImportError:
        raise FleetError("fleet.workers needs Ray, which is not installed: pip install 'ray==2.60.0' "
                         "(or reinstall posttrain: pip install -e .)") from None
    return ray


def _check_reachable(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise FleetError(f"fleet.ray_address={address!r}: expected 'auto' or HOST:PORT (the head's GCS port, 6379 by default)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise FleetError(f"fleet.ray_address={address}: no Ray cluster answers there within {timeout_s:g} s ({e}); "
                         f"start one with `ray start --head --port={port}` on that host") from None


def connect(fleet, *, num_cpus_needed: float, namespace: str | None = None) -> bool:
    """Starts (no address) or joins (`auto`, HOST:PORT) Ray, in the run's own `namespace` (where the other
    trainer processes find its parameter server by name); returns True when the run started it."""
    ray = require_ray()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback/private clusters (docs/tutorials/rl-fleet.md)
    env = {"env_vars": {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS")}}
    if ray.is_initialized():
        return False
    if fleet.ray_address is None:
        cpus = max(float(os.cpu_count() or 1), num_cpus_needed)
        with warnings.catch_warnings():  # Ray starts its processes by fork + exec; none of them runs JAX
            warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
            ray.init(address="local", num_cpus=int(-(-cpus // 1)), include_dashboard=False, log_to_driver=False,
                     runtime_env=env, namespace=namespace)
        _start_reaper()
        return True
    if fleet.ray_address != "auto":
        _check_reachable(fleet.ray_address, fleet.connect_timeout_s)
    try:
        ray.init(address=fleet.ray_address, runtime_env=env, log_to_driver=False, namespace=namespace)
    except (ConnectionError, RuntimeError) as e:
        raise FleetError(f"fleet.ray_address={fleet.ray_address}: cannot join the Ray cluster ({e})") from None
    return False


def join(address: str, namespace: str) -> None:
    """Another trainer process joins the Ray instance that process 0 started or joined (`address`: its GCS)."""
    ray = require_ray()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise FleetError(f"this trainer process cannot join process 0's Ray instance at {address} ({e}); every "
                         "trainer host must be a node of the Ray cluster (see docs/tutorials/rl-fleet.md: a "
                         "multi-host trainer with the fleet)") from None


def disconnect(started: bool) -> None:
    import ray  # lazy: this module imports without Ray (require_ray reports it missing)

    if ray.is_initialized():
        ray.shutdown()


def _start_reaper() -> None:
    """A watcher in its own session that, once this process is gone, ends what it had started (Ray included)."""
    with warnings.catch_warnings():  # fork + immediate exec: the child never runs JAX
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        subprocess.Popen([sys.executable, "-m", "posttrain.rl.fleet.reaper", str(os.getpid())],
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, close_fds=True)
