"""Multi-host runs on one machine: N processes x M CPU devices (JAX's CPU collectives over loopback) stand in
for N hosts, started as a user starts them (one `posttrain` command per host, with POSTTRAIN_* variables).

The multi-process tests are slow (each process compiles its own programs on a shared 2-core machine); every
process runs in its own process group with a time limit, and all of them are killed when a test fails
(`tests/multihost_helpers.py`). Commands other than sft and rl: `tests/test_multihost_commands.py`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import DISTINCT_REWARD, write_toy_task
from multihost_helpers import Procs, procs, tiny_llama  # noqa: F401  (fixtures)
from multihost_helpers import env as _env
from multihost_helpers import free_port as _free_port
from multihost_helpers import hosts as _hosts
from multihost_helpers import posttrain as _posttrain
from multihost_helpers import rows as _rows


# ---------------------------------------------------------------------- fast checks (one process)
def test_settings_from_config_and_environment(monkeypatch):
    from posttrain import distributed
    from posttrain.config import ConfigError
    from posttrain.training.config import DistributedConfig

    for k in ("POSTTRAIN_COORDINATOR", "POSTTRAIN_NUM_PROCESSES", "POSTTRAIN_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.resolve_settings(DistributedConfig(auto_detect=False)) is None  # one process: a no-op
    monkeypatch.setenv("POSTTRAIN_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("POSTTRAIN_NUM_PROCESSES", "4")
    with pytest.raises(ConfigError, match="missing: distributed.process_id"):
        distributed.resolve_settings(DistributedConfig())
    monkeypatch.setenv("POSTTRAIN_PROCESS_ID", "3")
    s = distributed.resolve_settings(DistributedConfig(heartbeat_timeout_s=9))
    assert (s["coordinator"], s["num_processes"], s["process_id"], s["heartbeat_timeout_s"]) == ("10.0.0.1:1234", 4, 3, 9)
    # the config wins over the environment
    assert distributed.resolve_settings(DistributedConfig(process_id=1))["process_id"] == 1
    with pytest.raises(ConfigError, match=r"process_id=5 must be in \[0, distributed.num_processes=4\)"):
        distributed.resolve_settings(DistributedConfig(process_id=5))


def test_cluster_detection_under_slurm(monkeypatch):
    """Inside a SLURM job step of several tasks, JAX's cluster detection supplies everything (auto); one task
    is one process."""
    from posttrain import distributed
    from posttrain.training.config import DistributedConfig

    for k in ("POSTTRAIN_COORDINATOR", "POSTTRAIN_NUM_PROCESSES", "POSTTRAIN_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    slurm = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="node[1-2]", SLURM_NTASKS="2", SLURM_PROCID="1",
                 SLURM_LOCALID="0")
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    assert distributed.resolve_settings(DistributedConfig())["auto"] is True
    assert distributed.resolve_settings(DistributedConfig(auto_detect=False)) is None
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.resolve_settings(DistributedConfig()) is None


def test_config_digests_name_the_differing_section():
    from posttrain import distributed
    from posttrain.training.sft import load_sft_config

    a = distributed.config_digests(load_sft_config(None, ["distributed.process_id=0"]))
    b = distributed.config_digests(load_sft_config(None, ["distributed.process_id=1", "optim.lr=0.5"]))
    assert "distributed" not in a and [k for k in a if a[k] != b[k]] == ["optim"]


def test_mesh_that_does_not_divide_the_devices_is_a_clear_error():
    from posttrain import distributed
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"needs 3 devices, there are 1"):
        distributed.make_mesh(data=3, fsdp=1, tensor=1)
    with pytest.raises(ConfigError, match="does not divide"):
        distributed.make_mesh(data=1, fsdp=-1, tensor=2)


def test_each_process_reads_its_rows_of_every_global_batch(tiny_llama):
    """Process shares of every global batch, put together, are the one-process batches (same order)."""
    from posttrain.models import tokenizer
    from posttrain.data import build_sft_dataset

    tok = tokenizer.load(tiny_llama)
    records = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(21)]
    kw = dict(seq_len=16, batch_size=4, pack=False, seed=3, num_epochs=2)
    whole = list(build_sft_dataset(records, tok, **kw))
    parts = [list(build_sft_dataset(records, tok, batch_rows=r, **kw)) for r in ([0, 1], [2, 3])]
    assert len(whole) == len(parts[0]) == len(parts[1]) == 11  # 42 rows: the last batch is padded
    for w, a, b in zip(whole, *parts):
        for k in w:
            np.testing.assert_array_equal(w[k], np.concatenate([a[k], b[k]]))


def test_sharded_load_reads_only_the_blocks_a_shard_needs(tiny_llama):
    """`from_pretrained` on a mesh builds each parameter from blocks: a shard's block of an HF tensor is read
    as that block (rows/columns of the [out, in] tensor), never the whole tensor, and equals the whole read."""
    from posttrain.models import hf_io

    folder, cfg = hf_io.load_config(tiny_llama)
    index = hf_io._TensorIndex(folder)
    whole_reads = []
    get = index.get
    index.get = lambda name: whole_reads.append(name) or get(name)
    q = "model.layers.1.self_attn.q_proj.weight"  # HF [heads*head_dim, embed] -> ours [embed, heads, head_dim]
    per_shape = (cfg.hidden_size, cfg.num_heads, cfg.head_dim)
    full = hf_io.to_ours(get(q), per_shape, 1)
    for idx in [(slice(8, 16), slice(0, 4), slice(0, 16)), (slice(0, 64), slice(2, 4), slice(0, 16))]:
        block = hf_io._read_layer_block(index, q, 1, per_shape, idx, {})
        np.testing.assert_array_equal(block, full[idx])
    assert whole_reads == []
    # a block that is no contiguous range of the HF tensor (part of head_dim) is cut from the whole tensor
    odd = (slice(0, 64), slice(0, 4), slice(0, 8))
    np.testing.assert_array_equal(hf_io._read_layer_block(index, q, 1, per_shape, odd, {}), full[odd])
    assert whole_reads == [q]


# JAX's own report when its coordination service learns of a death (process 0's stderr, process 1 killed)
JAX_ABORT = """\
E1125 14:42:57.193851   14134 coordination_service.cc:1549] [12503248184868177787] Use error polling to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
E1125 14:42:57.194333   14148 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1125 14:42:57.194466   14148 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details.
*** Check failure stack trace: ***
    @     0x7f772be40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""
# ... and process 1's when the coordinator (process 0) was killed
JAX_ABORT_COORDINATOR = """\
E1125 14:39:46.596427    8838 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1125 14:39:46.596458    8838 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details.
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"recvmsg:Connection reset by peer"}
*** Check failure stack trace: ***
"""


def _relay(text: str, debug: bool = False):
    import io

    from posttrain.cli.supervisor import StderrRelay

    out = io.BytesIO()
    relay = StderrRelay(io.BytesIO(text.encode()), out, debug)
    relay.run()
    return relay, out


def test_supervisor_turns_jax_abort_into_one_line_naming_the_dead_process():
    """The supervising command passes the child's stderr through but holds back JAX's distributed-runtime report;
    a child killed by JAX's abort ends the command with our one line (which process died) and exit 1."""
    from posttrain.cli.supervisor import outcome, what_jax_reported

    assert what_jax_reported(JAX_ABORT, 0, 2) == "process 1 of 2 stopped answering"
    assert what_jax_reported(JAX_ABORT.replace("\n1\n", "\n/job:jax_worker/replica:0/task:3\n"), 1) == \
        "process 3 stopped answering"
    assert what_jax_reported(JAX_ABORT_COORDINATOR, 1) == "the coordinator (process 0) stopped answering"
    assert what_jax_reported("Traceback (most recent call last):\n", 1) is None
    settings = {"process_id": 0, "num_processes": 2}
    relay, out = _relay("sft: tiny | steps 0->40\n" + JAX_ABORT)
    assert out.getvalue().decode() == "sft: tiny | steps 0->40\n" and relay.holding
    assert outcome(-signal.SIGABRT, relay, settings) == 1
    lines = out.getvalue().decode().splitlines()
    assert lines[0] == "sft: tiny | steps 0->40" and len(lines) == 2, lines
    assert lines[1].startswith("error: multi-host run: process 1 of 2 stopped answering (JAX's distributed service "
                               "reported it and ended this process); this process (process 0) stops too. Restart")
    relay, out = _relay(JAX_ABORT_COORDINATOR)
    assert outcome(-signal.SIGABRT, relay, {"process_id": 1, "num_processes": 2}) == 1
    assert out.getvalue().decode().startswith("error: multi-host run: the coordinator (process 0) stopped answering")
    # our watchdog spoke first (its line passes through even while holding): no second line, exit 1 either way
    ours = "error: multi-host run: process 1 of 2 stopped answering (nothing for 6s); this process (process 0) stops\n"
    for code in (1, -signal.SIGABRT):
        relay, out = _relay(JAX_ABORT[:300] + "\n" + ours + JAX_ABORT[300:])
        assert outcome(code, relay, settings) == 1 and out.getvalue().decode() == ours
    # seen in a full-suite run: the runtime's warning written onto the end of our line, then its message's other
    # lines (no log header of their own); the line is cut where the runtime's starts, and nothing after it passes
    mine = ours.rstrip("\n")
    glued = (f"{mine}W1126 17:59:30.870812   21324 preemption_sync_manager.cc:147] Failed: UNAVAILABLE: reset\n"
             "Additional GRPC error information from remote target coordination_service while calling ...:\n"
             ":UNKNOWN:Error received from peer  {grpc_status:14}. This is only expected if one of the tasks is\n")
    relay, out = _relay(glued)
    assert outcome(1, relay, settings) == 1 and out.getvalue().decode() == ours
    # a child that ends normally after runtime warnings: nothing is lost
    relay, out = _relay("W1125 14:40:32.492722   10245 preemption_sync_manager.cc:147] Failed to retrieve\nafter\n")
    assert out.getvalue() == b"" and outcome(0, relay, settings) == 0
    assert out.getvalue().decode().splitlines() == ["W1125 14:40:32.492722   10245 preemption_sync_manager.cc:147] "
                                                    "Failed to retrieve", "after"]
    # killed by something else: what it wrote, then our line saying so
    relay, out = _relay("ok\n")
    assert outcome(-signal.SIGKILL, relay, settings) == 1
    assert out.getvalue().decode().splitlines()[-1].startswith(
        "error: multi-host run: the work of process 0 of 2 ended by SIGKILL; this process stops too")
    # POSTTRAIN_DEBUG=1 holds nothing back
    relay, out = _relay(JAX_ABORT, debug=True)
    assert out.getvalue().decode() == JAX_ABORT


def test_only_a_multi_process_run_is_supervised(monkeypatch):
    """`initialize` hands a multi-process run to the registered supervisor before connecting; one process never
    reaches it (no extra process for a one-host run)."""
    from posttrain import distributed
    from posttrain.training.config import DistributedConfig

    class Handed(Exception):
        pass

    def supervise(settings):
        raise Handed(settings)

    for k in ("POSTTRAIN_COORDINATOR", "POSTTRAIN_NUM_PROCESSES", "POSTTRAIN_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(distributed, "_STATE", {"initialized": False, "watchdog": None, "supervisor": None})
    distributed.set_supervisor(supervise)
    assert distributed.initialize(DistributedConfig(auto_detect=False)) is False
    monkeypatch.setitem(distributed._STATE, "initialized", False)
    with pytest.raises(Handed) as e:
        distributed.initialize(DistributedConfig(coordinator="127.0.0.1:1", num_processes=2, process_id=1))
    assert (e.value.args[0]["process_id"], e.value.args[0]["num_processes"]) == (1, 2)
    assert distributed._STATE["supervisor"] is None  # handed over once: the child connects unsupervised
    assert distributed.jax_heartbeat_s(6) > 2 * 6  # JAX's own heartbeat fires well after the watchdog


# ---------------------------------------------------------------------- several processes
SHARDS = textwrap.dedent(
    """
    import json, sys
    from posttrain import distributed
    from posttrain.training.sft import build_model, load_sft_config

    pid = int(sys.argv[1])
    cfg = load_sft_config(None, [f"model.path={sys.argv[2]}", f"optim.lr={sys.argv[3]}"])
    distributed.initialize(cfg.distributed)  # from POSTTRAIN_* variables
    out = {"devices": [len(__import__("jax").devices()), len(__import__("jax").local_devices())]}
    try:
        distributed.check_same_config(cfg)
    except distributed.DistributedError as e:
        out["config_error"] = str(e)
    from posttrain.models import hf_io
    blocks = []
    get_block = hf_io._TensorIndex.get_block
    hf_io._TensorIndex.get_block = lambda self, name, index: blocks.append((name, str(index))) or get_block(self, name, index)
    model, _ = build_model(cfg.model, cfg.lora, cfg.trainer.seed, distributed.make_mesh())
    k = model.layers.mlp.up_proj.kernel[...]  # [layers, embed, mlp]: embed over fsdp (8 devices, 2 processes)
    out["kernel"] = [list(k.shape), str(k.sharding.spec),
                     sorted({(s.index[1].start, s.index[1].stop) for s in k.addressable_shards})]
    out["up_blocks"] = sorted({b for n, b in blocks if n == "model.layers.0.mlp.up_proj.weight"})
    out["sum"] = float(distributed.to_host(k).sum())
    distributed.finish()
    print("RESULT" + json.dumps(out), flush=True)
    """
)


@pytest.mark.slow
def test_two_processes_shard_parameters_and_refuse_different_configs(tmp_path, procs, tiny_llama):
    """Each process holds (and reads from safetensors) only its half of a weight sharded over the processes;
    a config that differs between processes is an error naming the section."""
    port = _free_port()
    ps = [procs.start([sys.executable, "-c", SHARDS, str(i), tiny_llama, "0.001" if i == 0 else "0.002"],
                      _env(4, POSTTRAIN_COORDINATOR=f"127.0.0.1:{port}", POSTTRAIN_NUM_PROCESSES=2,
                           POSTTRAIN_PROCESS_ID=i), tmp_path / f"p{i}.log") for i in range(2)]
    assert procs.wait(ps, 240) == [0, 0], procs.logs()
    out = [json.loads(next(x for x in Path(p.log).read_text().splitlines() if x.startswith("RESULT"))[6:]) for p in ps]
    for i, o in enumerate(out):
        assert o["devices"] == [8, 4]
        assert "optim differ from process 0's" in o["config_error"] and "process 1" in o["config_error"]
        shape, spec, owned = o["kernel"]
        assert spec == "P(None, 'fsdp', None)"
        embed = shape[1]
        # this process's devices hold embed rows [i * embed/2, (i+1) * embed/2): half of the weight
        assert owned == [[i * embed // 2 + j * embed // 8, i * embed // 2 + (j + 1) * embed // 8] for j in range(4)]
        # ... and read only those columns of HF's [mlp, embed] tensor from the safetensors file
        assert o["up_blocks"] == sorted(str((slice(0, shape[2]), slice(a, b))) for a, b in owned)
    assert out[0]["sum"] == out[1]["sum"]


@pytest.mark.slow
def test_unreachable_coordinator_is_a_clear_error_within_the_timeout(tmp_path, procs):
    p = procs.start(_posttrain("sft", "configs/sft_smoke.yaml", f"output_dir={tmp_path / 'out'}",
                               f"distributed.coordinator=127.0.0.1:{_free_port()}", "distributed.num_processes=2",
                               "distributed.process_id=1", "distributed.init_timeout_s=3"), _env(4), tmp_path / "p.log")
    t0 = time.monotonic()
    assert procs.wait([p], 120) == [1], procs.logs()
    log = Path(p.log).read_text()
    assert "error: process 1 of 2 could not join the run at 127.0.0.1:" in log and "within" in log, log
    assert "Traceback" not in log and time.monotonic() - t0 < 60


def _assert_last_word(p, start: str, procs: Procs) -> None:
    """The process's output ends with one line of ours starting with `start`: no traceback, no JAX abort."""
    lines = [x for x in Path(p.log).read_text(errors="replace").splitlines() if x.strip() and not x.startswith("[Gloo]")]
    assert lines and lines[-1].startswith(start), procs.logs()
    assert "Restart every process with the same command to resume from the last checkpoint" in lines[-1]
    text = "\n".join(lines)
    for native in ("Terminating process because", "Check failure stack trace", "Traceback", "Fatal Python error"):
        assert native not in text, (native, procs.logs())
    assert sum(x.startswith("error:") for x in lines) == 1, procs.logs()


SFT = ["configs/sft_smoke.yaml", "trainer.max_steps=12", "trainer.save_every=2", "trainer.log_every=1",
       "trainer.eval_every=0", "trainer.progress=false", "trainer.async_checkpointing=false", "export_hf=false",
       "distributed.heartbeat_timeout_s=6"]


@pytest.mark.slow
def test_sft_two_hosts_match_one_host_and_resume_after_a_host_dies(tmp_path, procs, tiny_llama):
    """2 processes x 4 devices give the per-step losses of 1 process x 8; killing one process ends the other
    with a clear error within the heartbeat timeout; restarting both resumes exactly from the last checkpoint."""
    args = _posttrain("sft", *SFT, f"model.path={tiny_llama}")
    one = procs.start(args + [f"output_dir={tmp_path / 'one'}"], _env(8), tmp_path / "one.log")
    assert procs.wait([one], 300) == [0], procs.logs()
    ref = _rows(tmp_path / "one", "loss")
    assert sorted(ref) == list(range(1, 13))

    two = tmp_path / "two"
    cache = dict(POSTTRAIN_COMPILE_CACHE=tmp_path / "jax-cache")  # the restarted processes compile nothing
    hosts = _hosts(procs, args + [f"output_dir={two}"], 2, 4, tmp_path, "run", **cache)
    deadline = time.monotonic() + 240
    while not ((two / "metrics.jsonl").exists() and len(_rows(two, "loss")) >= 3):  # a few steps done
        assert time.monotonic() < deadline and hosts[0].poll() is None, procs.logs()
        time.sleep(0.05)
    os.killpg(hosts[1].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert procs.wait([hosts[0]], 60) == [1], procs.logs()
    waited = time.monotonic() - killed_at
    _assert_last_word(hosts[0], "error: multi-host run: process 1 of 2 stopped answering", procs)
    assert waited < 30, waited
    done = len(_rows(two, "loss"))
    assert done < 12, "the run finished before the kill: nothing was tested"

    again = _hosts(procs, args + [f"output_dir={two}"], 2, 4, tmp_path, "resume", **cache)
    assert procs.wait(again, 300) == [0, 0], procs.logs()
    resumed = Path(again[0].log).read_text()
    assert "resumed from step" in resumed, resumed
    got = _rows(two, "loss")
    assert sorted(got) == list(range(1, 13))
    diff = max(abs(got[s] - ref[s]) for s in ref)
    print(f"\nkilled after {done} logged steps; other process exited in {waited:.1f}s; max |loss diff| {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.slow
def test_killing_the_coordinator_ends_the_others_with_one_line(tmp_path, procs, tiny_llama):
    """Process 0 (JAX's coordination service) killed mid-run: JAX's client in process 1 aborts natively at once;
    the `posttrain` command that supervises it ends with our one line instead, exit 1."""
    args = _posttrain("sft", *SFT, "trainer.max_steps=40", f"model.path={tiny_llama}", f"output_dir={tmp_path / 'run'}")
    hosts = _hosts(procs, args, 2, 4, tmp_path, "run")
    deadline = time.monotonic() + 240
    while not ((tmp_path / "run" / "metrics.jsonl").exists() and len(_rows(tmp_path / "run", "loss")) >= 2):
        assert time.monotonic() < deadline and hosts[1].poll() is None, procs.logs()
        time.sleep(0.05)
    os.killpg(hosts[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert procs.wait([hosts[1]], 60) == [1], procs.logs()
    waited = time.monotonic() - killed_at
    _assert_last_word(hosts[1], "error: multi-host run: the coordinator (process 0) stopped answering", procs)
    print(f"\nprocess 1 exited {waited:.1f}s after the coordinator was killed")
    assert waited < 30, waited


@pytest.mark.slow
def test_rl_two_hosts_match_one_host(tmp_path, procs, tiny_llama):
    """A short synchronous GRPO run: the sampler on the global mesh, rewards scored on process 0: rewards and
    losses equal those of one process with the same 8 devices."""
    write_toy_task(tmp_path, DISTINCT_REWARD)
    args = _posttrain(
        "rl", f"model.path={tiny_llama}", f"data.train={tmp_path / 'prompts.jsonl'}", "rollout.batch_prompts=4",
        "rollout.group_size=4", "rollout.max_new_tokens=8", f"rewards.functions=[{{name: '{tmp_path / 'reward.py'}:distinct'}}]",
        "rewards.correctness=null", "rewards.num_workers=0", "optim.lr=3e-3", "optim.decay=constant",
        "trainer.log_every=1", "trainer.save_every=0", "trainer.progress=false", "eval.at_start=false",
        "trainer.max_steps=2", "export_hf=false")
    one = procs.start(args + [f"output_dir={tmp_path / 'one'}"], _env(8), tmp_path / "one.log")
    assert procs.wait([one], 300) == [0], procs.logs()
    hosts = _hosts(procs, args + [f"output_dir={tmp_path / 'two'}"], 2, 4, tmp_path, "two")
    assert procs.wait(hosts, 400) == [0, 0], procs.logs()
    for key in ("reward/mean", "loss", "completion/length_mean"):
        a, b = _rows(tmp_path / "one", key), _rows(tmp_path / "two", key)
        assert sorted(a) == sorted(b) == [1, 2], key
        assert max(abs(a[s] - b[s]) for s in a) < 1e-5, (key, a, b)
    # a reward with signal (distinct characters, not a rare letter: whether a tiny random model writes one at step 2
    # hung on Adam's first step, which scales the ~1e-7 gradient of a zero-advantage batch, the k3 KL of two
    # passes that differ in float rounding, up to lr, in a direction set by the batch's layout)
    assert min(_rows(tmp_path / "one", "reward/std").values()) > 0
    samples = [json.loads(x) for x in open(tmp_path / "two" / "samples.jsonl")]
    assert [s["step"] for s in samples] == [1, 2]  # written once (by process 0)


def test_a_known_error_from_a_failed_collective_asks_whether_a_peer_died_first(monkeypatch, tmp_path, capsys):
    """A checkpoint save whose collective failed (a peer died mid-save) raises a known error wrapping JAX's
    runtime error: the CLI asks whether every peer still answers before reporting it (the watchdog then says
    which process died, in one line); a known error of another cause is reported at once."""
    import importlib.machinery
    import types

    import jax

    from posttrain import distributed
    from posttrain.cli import main as cli
    from posttrain.training.errors import CheckpointSaveError

    asked = []
    monkeypatch.setattr(distributed, "peers_alive", lambda *a, **k: asked.append(True) or True)
    monkeypatch.setattr(distributed, "initialize", lambda *a, **k: False)
    for cause, want in ((jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed"), [True]),
                        (OSError(28, "No space left on device"), [])):
        asked.clear()

        def run(args, cause=cause):
            raise CheckpointSaveError("cannot write checkpoints to X") from cause

        fake = types.ModuleType("posttrain_fake_sub")
        fake.run, fake.add_arguments = run, lambda p: None
        fake.__spec__ = importlib.machinery.ModuleSpec("posttrain_fake_sub", None)
        monkeypatch.setitem(sys.modules, "posttrain_fake_sub", fake)
        monkeypatch.setitem(cli.SUBCOMMANDS, "sft", ("posttrain_fake_sub", "fake"))
        assert cli._main(["--no-compile-cache", "sft"]) == 1
        assert asked == want
        assert capsys.readouterr().err.strip().endswith("error: cannot write checkpoints to X")


def test_a_new_program_is_compiled_by_every_process_before_it_runs(monkeypatch):
    """Several processes: the first call of each input signature of a jitted function compiles it, then waits at a
    coordination-service barrier for the others (gloo gives a peer 30 s to join a new program's collectives); later
    calls with that signature run at once; one process calls it directly."""
    import jax
    import jax.numpy as jnp
    from jax._src import distributed as jd

    from posttrain import distributed

    events = []

    class Client:
        def wait_at_barrier(self, name, timeout_in_ms):
            events.append(("barrier", name))

    f = jax.jit(lambda x: events.append(("trace", x.shape)) or x * 2)
    assert float(distributed.call_compiled(f, jnp.ones(()))) == 2.0 and ("barrier" not in {e[0] for e in events})
    events.clear()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jd.global_state, "client", Client())
    monkeypatch.setitem(distributed._STATE, "compiled", set())
    for shape in [(2,), (2,), (3,), (2,)]:
        np.testing.assert_array_equal(distributed.call_compiled(f, jnp.ones(shape)), 2 * np.ones(shape))
    assert events == [("trace", (2,)), ("barrier", "posttrain/compiled/1"), ("trace", (3,)),
                      ("barrier", "posttrain/compiled/2")], events
