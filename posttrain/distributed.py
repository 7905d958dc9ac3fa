"""Device meshes, the one table of logical-axis rules that maps parameter and activation axes onto them, and
multi-host start-up (JAX's multi-controller model: one process per host, all running the same program).

Mesh axes: `data` (pure data parallelism), `fsdp` (data parallelism with parameters sharded, ZeRO-3
style), `expert` (expert parallelism: a mixture of experts' expert weights split by expert, and the batch split
over it too, so that outside the experts it is one more data axis; `posttrain.models.expert_parallel`) and
`tensor` (Megatron-style tensor parallelism). Every parameter carries logical axis
names (flax's `out_sharding` metadata); `LOGICAL_RULES` turns each logical name into a mesh axis (or None = replicated).
Meshes are built with Auto axis types (sharding propagated by the compiler), stated explicitly since
`jax.make_mesh` defaults to Explicit axes in recent JAX.

Multi-host: `initialize(cfg.distributed)` (every command, before any device is touched) connects the
processes through JAX's coordination service; `jax.devices()` then lists every process's devices and the
mesh spans all of them. `check_same_config` compares a hash of the resolved config across processes, and a
watchdog ends a process with one clear line when another stops answering (instead of a hang). JAX's own
heartbeat is set well above the watchdog's so that the watchdog speaks first; the coordinator's death (which
JAX's client answers with a native abort at once) is turned into the same one line by the `posttrain` command,
which supervises the process that runs JAX (`set_supervisor`, `posttrain.cli.supervisor`). On one
process all of this is a no-op. Helpers for code that reads arrays on the host (`to_host`: every process
must call it, it runs a collective) and for writing files once (`is_primary`); `call_compiled` runs a jitted
program only once every process has compiled it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from posttrain.config import ConfigError, to_dict

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the mesh axes a batch is split over (the "batch" rule)


class MeshError(ConfigError):
    """Mesh sizes that do not fit the devices (of all processes)."""


class DistributedError(RuntimeError):
    """A multi-host start-up or run problem: coordinator unreachable, configs differ, a process died."""

# logical name -> mesh axis (or tuple of axes, or None). First match wins; a mesh axis is used once per array.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "seq": None,
    "act_embed": None,
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "lora_rank": None,
    "expert": "expert",  # a mixture of experts' stacked expert weights [expert, ...]
    "router": None,  # the router's expert axis: every device routes its own tokens over all experts
    "vision_patches": None,  # the SigLIP position table's patch axis (its embed axis follows "embed")
}


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, expert: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh with Auto axes over every process's devices; one size may be -1 (= the
    remaining devices). Sizes that do not divide the (global) device count are a `MeshError`."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, expert, tensor]
    named = lambda: dict(zip(MESH_AXES, sizes))
    if sizes.count(-1) > 1:
        raise MeshError("at most one mesh axis size (mesh.data, mesh.fsdp, mesh.expert, mesh.tensor) may be -1")
    if any(s == 0 or s < -1 for s in sizes):
        raise MeshError(f"mesh sizes must be >= 1 or -1, found {named()}")
    known = int(np.prod([s for s in sizes if s != -1]))
    where = f" ({jax.process_count()} processes x {jax.local_device_count()})" if jax.process_count() > 1 else ""
    if -1 in sizes:
        if len(devices) % known:
            raise MeshError(f"mesh {named()}: {known} does not divide the {len(devices)} devices{where}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise MeshError(f"mesh {named()} needs {int(np.prod(sizes))} devices, there are "
                        f"{len(devices)}{where}; set the mesh sizes so that their product is the device count "
                        "(or one of them to -1)")
    if jax.process_count() > 1:
        # Every process's devices must fill whole positions of the batch axes (data x fsdp x expert) so that each
        # process feeds its own rows of every global batch (and no mesh axis splits a host's devices unevenly).
        local = len([d for d in devices if d.process_index == jax.process_index()])
        if local == 0 or len(devices) % local:
            raise MeshError(f"mesh {named()}: this process has {local} of the {len(devices)} "
                             "devices; every process must hold the same number")
    arr = np.asarray(devices).reshape(sizes)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_ways(mesh: Mesh | None) -> int:
    """Into how many parts a batch is split on `mesh`: the product of its batch axes' sizes (data x fsdp x expert;
    1 without a mesh). Batch sizes that it divides are split over all of them (`logical_to_spec`)."""
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape.get(a, 1) for a in BATCH_AXES]))


def devices_mesh() -> Mesh | None:
    """The mesh of a command without a mesh section (eval, generate): every device of every process on the fsdp
    axis, as `mesh.fsdp: -1` gives a training command; None on one device."""
    return make_mesh() if jax.device_count() > 1 else None


def logical_to_spec(logical_axes: Sequence[str | None] | None, shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None, rules=None) -> PartitionSpec:
    """PartitionSpec for logical axis names. An array axis mapped to several mesh axes (the batch: data, fsdp,
    expert) whose size their product does not divide keeps the longest leading run of them that divides it (the
    rest replicate it), so a batch that the expert axis does not divide is still split over data and fsdp."""
    rules = LOGICAL_RULES if rules is None else rules
    if not logical_axes:
        return PartitionSpec()
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical_axes):
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and (mesh is None or mesh.shape.get(a, 1) > 1))
        if axes and shape is not None and mesh is not None:
            while axes and shape[i] % int(np.prod([mesh.shape[a] for a in axes])):
                axes = axes[:-1]
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def sharding_for_axes(variable: nnx.Variable, shape, mesh: Mesh | None) -> NamedSharding | None:
    """NamedSharding of a parameter of `shape` on `mesh` by its logical axes (None without a mesh)."""
    if mesh is None:
        return None
    return NamedSharding(mesh, logical_to_spec(getattr(variable, "out_sharding", None), shape, mesh))


def state_shardings(state: nnx.State, mesh: Mesh):
    """A pytree of NamedShardings matching an `nnx.State` of Variables (or their abstract shapes)."""
    return jax.tree.map(
        lambda v: NamedSharding(mesh, logical_to_spec(getattr(v, "out_sharding", None), v[...].shape, mesh)),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places every parameter of `model` by its logical axes on `mesh` (in place) and returns the model."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh)
    values = jax.tree.map(lambda v: v[...], state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    placed = jax.device_put(values, jax.tree.map(lambda s: s, shardings, is_leaf=lambda x: isinstance(x, NamedSharding)))
    nnx.update(model, placed)
    model.mesh = mesh
    return model


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding for a [batch, ...] input array: batch over (data, fsdp, expert), the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), None, mesh))


def process_batch_rows(mesh: Mesh | None, batch_size: int) -> list[int] | None:
    """The rows of every [batch_size, ...] global batch that this process's devices hold (None: all of them,
    one process). A batch size that the batch axes (data x fsdp x expert) do not divide is a `ConfigError`."""
    if mesh is None or jax.process_count() == 1:
        return None
    ways = batch_ways(mesh)
    if batch_size % ways:
        raise ConfigError(f"data.batch_size={batch_size} must be divisible by mesh.data x mesh.fsdp x mesh.expert = "
                          f"{ways} in a multi-host run (each device holds whole rows)")
    index = batch_sharding(mesh, 1).addressable_devices_indices_map((batch_size,))
    return sorted({r for sl in index.values() for r in range(*sl[0].indices(batch_size))})


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None) -> jax.Array:
    """`with_sharding_constraint` by logical names when a mesh is in use; identity otherwise."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical_axes, x.shape, mesh)))


# ---------------------------------------------------------------------- multi-host
ENV_COORDINATOR = ("POSTTRAIN_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
ENV_NUM_PROCESSES = ("POSTTRAIN_NUM_PROCESSES", "JAX_NUM_PROCESSES")
ENV_PROCESS_ID = ("POSTTRAIN_PROCESS_ID", "JAX_PROCESS_ID")

_STATE: dict[str, Any] = {"initialized": False, "watchdog": None, "supervisor": None, "compiled": set()}
COMPILED_BARRIER_S = 3600  # how long a process waits for the others to compile a program (a death ends it sooner)


def jax_heartbeat_s(heartbeat_timeout_s: int) -> int:
    """JAX's own heartbeat timeout for our `distributed.heartbeat_timeout_s`: well above it, so that the watchdog
    (one clear line) always acts before JAX's coordination service aborts the processes natively."""
    return 2 * int(heartbeat_timeout_s) + 30


def set_supervisor(supervise) -> None:
    """Registers `supervise(settings)` (the `posttrain` command's): `initialize` calls it, instead of connecting,
    when the run has several processes; it runs the command again as a child process that does the work and
    ends this process with the child's outcome (a peer's death reported in one line). None unregisters it."""
    _STATE["supervisor"] = supervise


def peer_lost_message(what: str, me: int | None) -> str:
    """The one line for a multi-host run that cannot go on because `what` (a process stopped answering)."""
    this = f" (process {me})" if me is not None else ""
    return (f"error: multi-host run: {what}; this process{this} stops too. Restart every process with the same "
            "command to resume from the last checkpoint")


def _env(names: tuple[str, ...]) -> str | None:
    for n in names:
        v = os.environ.get(n, "").strip()
        if v:
            return v
    return None


def _env_int(names: tuple[str, ...]) -> int | None:
    v = _env(names)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"environment variable {names[0]}={v!r} is not an integer") from None


def _detected_cluster():
    """JAX's cluster environment (TPU pod slice, SLURM, Open MPI, ...) when one is present with more than one
    process, else None."""
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - JAX moved its cluster detection
        return None
    for env in clusters.ClusterEnv._cluster_types:
        try:
            if env.opt_in_only_method or not env.is_env_present():
                continue
            if int(env.get_process_count() or 1) > 1:
                return env
        except Exception:  # noqa: BLE001 - a half-configured environment is not a cluster
            continue
    return None


def resolve_settings(cfg=None) -> dict[str, Any] | None:
    """What `initialize` would connect with: {coordinator, num_processes, process_id, ...}, or None for a single
    process. Config fields win over the environment; JAX's cluster detection fills in the rest (`auto`)."""
    get = (lambda name, default=None: getattr(cfg, name, default)) if cfg is not None else (lambda n, d=None: d)
    coordinator = get("coordinator") or _env(ENV_COORDINATOR)
    num = get("num_processes")
    num = num if num is not None else _env_int(ENV_NUM_PROCESSES)
    pid = get("process_id")
    pid = pid if pid is not None else _env_int(ENV_PROCESS_ID)
    common = {"init_timeout_s": int(get("init_timeout_s", 300)), "heartbeat_timeout_s": int(get("heartbeat_timeout_s", 60))}
    if num is not None and num <= 1 and coordinator is None:
        return None
    if coordinator is None and num is None and pid is None:
        if not get("auto_detect", True) or _detected_cluster() is None:
            return None
        return {"coordinator": None, "num_processes": None, "process_id": None, "auto": True, **common}
    missing = [name for name, v in (("coordinator", coordinator), ("num_processes", num), ("process_id", pid))
               if v is None]
    if missing and _detected_cluster() is None:
        raise ConfigError(
            "a multi-process run needs distributed.coordinator (host:port of process 0), distributed.num_processes "
            f"and distributed.process_id (or POSTTRAIN_COORDINATOR, POSTTRAIN_NUM_PROCESSES, POSTTRAIN_PROCESS_ID); "
            f"missing: {', '.join('distributed.' + m for m in missing)}")
    if num is not None and pid is not None and not 0 <= pid < num:
        raise ConfigError(f"distributed.process_id={pid} must be in [0, distributed.num_processes={num})")
    return {"coordinator": coordinator, "num_processes": num, "process_id": pid, "auto": bool(missing), **common}


def initialize(cfg=None) -> bool:
    """Connects this process to the others (`jax.distributed.initialize`) when the config (a
    `DistributedConfig`), the environment or the cluster says there are several; returns whether it did.

    Must run before anything touches a device. A no-op on one process, and when called again. A coordinator
    not reached within `init_timeout_s` is a `DistributedError`; afterwards a watchdog ends the process with
    an error line when another process stops answering for `heartbeat_timeout_s` (see `Watchdog`).
    """
    if _STATE["initialized"]:
        return jax.process_count() > 1
    settings = resolve_settings(cfg)
    _STATE["initialized"] = True
    if settings is None:
        return False
    supervise, _STATE["supervisor"] = _STATE["supervisor"], None
    if supervise is not None:
        supervise(settings)  # does not return: a child process runs the command (and comes back here unsupervised)
    # CPU devices of several processes talk over TCP (gloo); GPUs and TPUs use their own collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {k: settings[k] for k in ("coordinator", "num_processes", "process_id") if settings[k] is not None}
    if "coordinator" in kwargs:
        kwargs["coordinator_address"] = kwargs.pop("coordinator")
    where = settings["coordinator"] or "the detected coordinator"
    who = f"process {settings['process_id']} of {settings['num_processes']}"

    def message(reason: str) -> str:
        return (f"{who} could not join the run at {where} within {settings['init_timeout_s']}s "
                f"(distributed.init_timeout_s): {reason}. Start every process with the same coordinator address "
                "and process count, and check that process 0's host is reachable on that port")

    def give_up():  # JAX aborts natively when its own (later) deadline passes: say why first, in one line
        print(f"error: {message(_why_not_joined(settings))}", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(settings["init_timeout_s"], give_up)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=settings["init_timeout_s"] + 30,
                                   heartbeat_timeout_seconds=jax_heartbeat_s(settings["heartbeat_timeout_s"]),
                                   shutdown_timeout_seconds=max(settings["heartbeat_timeout_s"], 30))
    except Exception as e:  # noqa: BLE001 - a bad address or a connection failure, reported in one line
        raise DistributedError(message(" ".join(str(e).split())[:300])) from None
    finally:
        timer.cancel()
    _rearm_sigterm()
    _STATE["watchdog"] = Watchdog(settings["heartbeat_timeout_s"]).start()
    return True


def _rearm_sigterm() -> None:
    """JAX's preemption notifier, started by `jax.distributed.initialize`, installs its own (native) SIGTERM
    handler, which only records the signal: the run would go on. The Python handler the command had installed
    (a clean stop, `posttrain.cli.main`) is put back in charge."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        signal.signal(signal.SIGTERM, handler)


def _why_not_joined(settings: dict) -> str:
    """A guess at why joining timed out: nobody listening at the coordinator's address, or processes missing."""
    import socket

    coordinator = settings.get("coordinator")
    if settings.get("process_id") not in (None, 0) and coordinator:
        host, _, port = coordinator.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                pass
        except (OSError, ValueError):
            return "nothing answers at that address (is process 0 running?)"
    n = settings.get("num_processes")
    return f"not all {n} processes joined" if n else "not all processes joined"


def is_primary() -> bool:
    """True on the process that writes shared files (metrics, samples, the HF export, config.yaml): process 0."""
    return jax.process_index() == 0


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def to_host(tree):
    """Numpy copies of a pytree of arrays, whole (gathered from every device of every process). With several
    processes this is a collective: every process must call it at the same point of the program."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(jax.device_get(x))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def broadcast_json(value: Any) -> Any:
    """Process 0's `value` (anything JSON-able) on every process (a collective; others pass anything)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8) if is_primary() else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.zeros(n, np.uint8)
    buf[: len(data)] = data[:n]
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
    return json.loads(out.tobytes().decode())


_KV_PART = 2**21  # bytes per key-value entry (well under gRPC's message limit)


def _kv_client():
    from jax._src import distributed as jd

    return jd.global_state.client


def post_json(key: str, value: Any) -> None:
    """Process 0 leaves `value` (JSON-able, any size) under `key` in the coordination service for the others to
    `wait_json`: unlike `broadcast_json` no device collective waits meanwhile, so the others may wait for long
    (a process that dies meanwhile is the watchdog's). No-op on one process."""
    if jax.process_count() == 1:
        return
    data = json.dumps(value).encode()
    client = _kv_client()
    n = max(1, -(-len(data) // _KV_PART))
    for i in range(n):
        client.key_value_set_bytes(f"{key}/{i}", data[i * _KV_PART:(i + 1) * _KV_PART])
    client.key_value_set(f"{key}/n", str(n))


def wait_json(key: str, *, poll_s: float = 1.0) -> Any:
    """The value process 0 `post_json`ed under `key`, waiting for it as long as it takes."""
    client = _kv_client()
    while True:
        try:
            n = int(client.blocking_key_value_get(f"{key}/n", int(poll_s * 1000)))
            break
        except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED: not there yet; anything else is real
            if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
                raise
    data = b"".join(client.blocking_key_value_get_bytes(f"{key}/{i}", 60_000) for i in range(n))
    return json.loads(data.decode())


def drop_posted(key: str) -> None:
    """Removes what `post_json` left under `key` (process 0, once every process has read it)."""
    if jax.process_count() > 1:
        _kv_client().key_value_delete(key)


def config_digests(cfg) -> dict[str, str]:
    """A digest of every top-level section of a resolved config (the `distributed` section left out: the
    process ids differ by design)."""
    d = to_dict(cfg)
    d.pop("distributed", None)
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
            for k, v in d.items()}


def check_same_config(cfg) -> None:
    """Raises `DistributedError` naming the sections where this process's resolved config differs from
    process 0's (every process calls it at start-up; a no-op on one process)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = config_digests(cfg)
    keys = sorted(mine)
    local = np.frombuffer("".join(mine[k] for k in keys).encode(), np.uint8).reshape(1, -1)
    # every process gets every process's digests, so each can say what differs (a collective)
    allof = np.asarray(multihost_utils.process_allgather(local, tiled=True)).reshape(jax.process_count(), len(keys), 16)
    bad: dict[int, list[str]] = {}
    for p in range(1, jax.process_count()):
        diff = [k for i, k in enumerate(keys) if not np.array_equal(allof[p, i], allof[0, i])]
        if diff:
            bad[p] = diff
    if bad:
        what = "; ".join(f"process {p}: {', '.join(v)}" for p, v in sorted(bad.items()))
        raise DistributedError(f"the resolved config differs between processes ({what} differ from process 0's). "
                               "Start every process with the same config file and key=value overrides")


def call_compiled(fn, *args):
    """`fn(*args)` for a jitted `fn`. In a multi-process run, the first call with each input signature compiles
    `fn` ahead of time and then waits until every process has compiled it (a barrier of the coordination service,
    not a device collective) before running it: JAX's CPU collectives (gloo) give a peer 30 s to join a program's
    new communicator, and on a loaded machine compilation times of the processes differ by more than that (the
    first step after a resume failed with `Gloo context initialization failed: DEADLINE_EXCEEDED`)."""
    if jax.process_count() == 1:
        return fn(*args)
    leaves, tree = jax.tree.flatten(args)
    key = (fn, tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
                           for x in leaves))
    if key not in _STATE["compiled"]:
        fn.lower(*args).compile()  # jit keeps it: the call below compiles nothing
        _STATE["compiled"].add(key)
        from jax._src import distributed as jd

        if jd.global_state.client is not None:  # the same programs in the same order on every process
            jd.global_state.client.wait_at_barrier(f"posttrain/compiled/{len(_STATE['compiled'])}",
                                                   COMPILED_BARRIER_S * 1000)
    return fn(*args)


def barrier(name: str) -> None:
    """Every process waits here for the others (no-op on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class Watchdog:
    """Ends this process with one error line when another process stops answering, instead of waiting in a
    collective forever (JAX's own heartbeat, `jax_heartbeat_s`, is set to fire well after this one).

    Every process bumps its own counter in the coordination service's key-value store once a second and reads
    the others'; a counter that has not moved for `timeout_s` (or a coordinator that no longer answers) means
    that process is gone: the run cannot go on, and all processes must be restarted (they resume from the last
    checkpoint). `stop()` before a normal exit.
    """

    def __init__(self, timeout_s: float, interval_s: float = 1.0):
        self.timeout_s = max(1.0, float(timeout_s))
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy_seen: dict[tuple[int, str], float] = {}

    def start(self) -> "Watchdog":
        from jax._src import distributed as jd

        state = jd.global_state
        self._client = state.client
        if self._client is None:
            return self
        # never jax.process_index() here: in this thread it could race the main thread's backend start-up
        self.me, self.n = int(state.process_id), int(state.num_processes)
        self._thread = threading.Thread(target=self._run, name="posttrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        me, n = self.me, self.n
        seen: dict[int, tuple[str | None, float]] = {}  # process -> (its counter, when it last moved)
        count = 0
        started = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                count += 1
                self._client.key_value_set(f"posttrain/alive/{me}", str(count), allow_overwrite=True)
                for p in range(n):
                    if p == me:
                        continue
                    v = self._client.key_value_try_get(f"posttrain/alive/{p}")
                    if p not in seen or seen[p][0] != v:
                        seen[p] = (v, now)
                    elif now - seen[p][1] > self.timeout_s and not self._excused(p, now):
                        self._fail(f"process {p} of {n} stopped answering (nothing for {now - seen[p][1]:.0f}s)")
            except Exception as e:  # noqa: BLE001 - the coordinator (process 0) is gone, or a key never came
                if "NOT_FOUND" in str(e) and now - started < self.timeout_s:
                    continue
                if self._stop.is_set():
                    return
                what = "the coordinator (process 0) stopped answering" if me != 0 else "the coordination service failed"
                self._fail(f"{what} ({' '.join(str(e).split())[:160]})")

    def _excused(self, p: int, now: float) -> bool:
        """Whether process `p` said it is in a call that may hold its interpreter (`busy`) and is still within the
        seconds it asked for, counted from when this process first saw that notice."""
        try:
            v = self._client.key_value_try_get(f"posttrain/busy/{p}")
        except Exception:  # noqa: BLE001 - NOT_FOUND: no notice
            return False
        first = self._busy_seen.setdefault((p, v), now)
        return now - first < float(v.rsplit(":", 1)[1])

    def peers_alive(self, max_s: float | None = None) -> bool:
        """Waits until every other process has bumped its counter since this call (read afresh from the
        coordinator: a bump the watchdog had not seen yet may predate a death) and returns True, or returns False
        after `max_s` (default: the timeout and a little). A process that died meanwhile ends this one from the
        watchdog's thread with its one line, so an error the main thread saw after a peer's death says what
        happened instead of a traceback."""
        if self._thread is None or self._stop.is_set():
            return True
        deadline = time.monotonic() + (max_s if max_s is not None else self.timeout_s + 3 * self.interval_s)
        others = [p for p in range(self.n) if p != self.me]
        first: dict[int, str | None] | None = None
        while time.monotonic() < deadline:
            now = self._counters(others)
            if first is None:
                first = now
            elif now is not None and all(now[p] != first[p] for p in others):
                return True
            time.sleep(self.interval_s / 4)
        return False

    def _counters(self, processes: list[int]) -> dict[int, str | None] | None:
        """The processes' counters as the coordinator holds them now (None: not bumped yet); None when the
        coordinator does not answer (the watchdog's thread says so)."""
        out: dict[int, str | None] = {}
        for p in processes:
            try:
                out[p] = self._client.key_value_try_get(f"posttrain/alive/{p}")
            except Exception as e:  # noqa: BLE001 - NOT_FOUND: no bump yet; anything else: the coordinator is gone
                if "NOT_FOUND" not in str(e):
                    return None
                out[p] = None
        return out

    def _fail(self, what: str) -> None:
        if self._stop.is_set():
            return
        sys.stderr.flush()  # then the line in one write: the runtime's own log lines cannot land inside it
        os.write(2, (peer_lost_message(what, self.me) + "\n").encode(errors="replace"))
        os._exit(1)

    def stop(self) -> None:
        self._stop.set()


@contextlib.contextmanager
def busy(seconds: float):
    """Around a call that may hold this process's interpreter (the GIL) for long, e.g. joining Ray: this process's
    watchdog cannot bump its counter meanwhile, so the other processes' watchdogs wait up to `seconds` more
    before they call it dead (a no-op on one process)."""
    dog = _STATE.get("watchdog")
    if dog is None or dog._thread is None:
        yield
        return
    key = f"posttrain/busy/{dog.me}"
    dog._client.key_value_set(key, f"{time.monotonic_ns()}:{float(seconds)}", allow_overwrite=True)
    try:
        yield
    finally:
        try:
            dog._client.key_value_delete(key)
        except Exception:  # noqa: BLE001 - the coordinator is gone: the watchdog says so
            pass


def peers_alive(max_s: float | None = None) -> bool:
    """In a multi-process run, whether every other process still answers (see `Watchdog.peers_alive`: a dead one
    ends this process with the watchdog's line first); True on one process."""
    dog = _STATE.get("watchdog")
    return True if dog is None else dog.peers_alive(max_s)


def finish() -> None:
    """A multi-process run's normal end: every process waits for the others, stops its watchdog and leaves the
    coordination service (a no-op on one process)."""
    dog = _STATE.get("watchdog")
    if jax.process_count() == 1 or dog is None:
        return
    barrier("posttrain-finish")
    dog.stop()
    _STATE["watchdog"] = None
    jax.distributed.shutdown()
