"""RL set-up as data and each concept once: the `algorithm` section is the typed preset, the agent's limits one
section with one set of defaults, the rollout sources' shared intake over the dispatcher, `build_rl`'s clean-up
on an error, and no class on the RL path holding more than 15 instance attributes."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from posttrain.agent.rollout import AgentLimits
from posttrain.algorithms import registry
from posttrain.config import ConfigError, load_config, save_config
from posttrain.rl.config import RLConfig, RolloutConfig
from posttrain.rl.dispatcher import Dispatcher
from posttrain.rl.sources import DynamicSampling, GroupIntake
from posttrain.rollout.rollouts import Rollouts

PACKAGE = Path(__file__).resolve().parents[1] / "posttrain"


# ---------------------------------------------------------------------- the algorithm section is the typed preset
def test_algorithm_section_parses_straight_into_the_typed_preset(tmp_path):
    cfg = load_config(RLConfig, None, ["algorithm.preset=dapo", "algorithm.beta=0.01"])
    assert type(cfg.algorithm) is registry.DAPO and cfg.algorithm == registry.get_preset("dapo", beta=0.01)
    assert cfg.algorithm.epsilon_high == 0.28  # a section given in part keeps its own preset's defaults
    assert load_config(RLConfig, None, ["algorithm.beta=0.1"]).algorithm == registry.get_preset("grpo", beta=0.1)
    assert load_config(RLConfig).algorithm == registry.PRESETS["grpo"]
    save_config(cfg, tmp_path / "c.yaml")  # the saved config names every setting and loads back the same
    assert load_config(RLConfig, tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("override,message", [
    ("algorithm.bogus=1", ("unknown config key 'algorithm.bogus'; valid keys at 'algorithm' (GRPOFamily): preset, "
                           "advantage, ratio_level")),
    ("algorithm.preset=ppo", ("config key 'algorithm.preset': invalid value 'ppo'; accepted values: 'grpo', "
                              "'dr_grpo', 'dapo', 'gspo', 'rloo'")),
    ("algorithm.aggregation=sum", ("config key 'algorithm.aggregation': invalid value 'sum'; accepted values: "
                                   "'token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum_norm'")),
    ("algorithm.beta=high", "config key 'algorithm.beta': expected float, found 'high' (str)"),
    ("algorithm.epsilon_low=-1", "algorithm.epsilon_low must be >= 0, found -1"),
    ("algorithm.is_cap=3", "config key algorithm.is_cap moved to learner.is_cap"),
])
def test_algorithm_section_errors_name_the_key_and_what_it_accepts(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, None, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_policy_loss_kwargs_come_from_the_typed_preset():
    from posttrain.rl.learner import policy_loss_kwargs

    kw = policy_loss_kwargs(registry.get_preset("gspo", beta=0.02), 64)
    assert (kw["ratio_level"], kw["epsilon_high"], kw["beta"], kw["kl_estimator"]) == ("sequence", 4e-4, 0.02, "k3")
    assert kw["max_tokens"] == 64  # the generation budget: the preset leaves it unset
    assert not {"is_level", "is_cap", "is_weights"} & set(kw)  # the rollout correction travels with the batch
    kw = policy_loss_kwargs(registry.get_preset("dapo", max_tokens=10), 64)
    assert kw["max_tokens"] == 10 and "kl_estimator" not in kw  # no KL term: no estimator


# ---------------------------------------------------------------------- the agent's limits: one section
def test_agent_limits_are_one_section_with_one_set_of_defaults():
    limit_keys = [f.name for f in dataclasses.fields(AgentLimits)]
    rollout = RolloutConfig()
    assert isinstance(rollout, AgentLimits)  # the rollout section holds these keys (rollout.max_turns, ...)
    assert {k: getattr(rollout, k) for k in limit_keys} == dataclasses.asdict(AgentLimits())
    cfg = load_config(RLConfig, None, ["rollout.max_turns=3", "rollout.max_new_tokens=20", "rollout.tools=[calculator]"])
    assert cfg.rollout.limits(cfg.rollout.max_new_tokens) == AgentLimits(max_turns=3, max_total_tokens=60)
    assert cfg.rollout.completion_budget == 60  # what the loss normaliser and the overlong penalty use
    cfg = load_config(RLConfig, None, ["rollout.max_total_tokens=50", "rollout.tools=[calculator]"])
    assert cfg.rollout.limits(cfg.rollout.max_new_tokens).max_total_tokens == cfg.rollout.completion_budget == 50
    with pytest.raises(ConfigError, match="rollout.tool_timeout_s must be > 0, found 0"):
        load_config(RLConfig, None, ["rollout.tool_timeout_s=0"])
    with pytest.raises(ValueError, match="rollout.max_tool_output_tokens must be >= 1"):
        AgentLimits(max_tool_output_tokens=0)  # the same checks wherever the limits are made


def test_eval_and_generate_options_fill_the_same_limits():
    from posttrain.cli.agent_args import LIMIT_OPTIONS, add_agent_arguments, options
    from posttrain.rollout.config import LIMIT_KEYS, AgentOptions

    def rollout_section(args):
        return options(AgentOptions, args).rollout_section()

    p = argparse.ArgumentParser()
    add_agent_arguments(p)
    assert {key for _, key, _, _ in LIMIT_OPTIONS} == set(LIMIT_KEYS)
    assert set(LIMIT_KEYS) <= {f.name for f in dataclasses.fields(AgentLimits)}
    assert set(LIMIT_KEYS) <= {f.name for f in dataclasses.fields(AgentOptions)}
    section = rollout_section(p.parse_args(["--tools", "calculator"]))
    assert section.limits(1) == AgentLimits().limits(1)  # unset options: the section's defaults
    section = rollout_section(p.parse_args(["--tools", "calculator", "--max-turns", "2", "--tool-timeout", "1.5"]))
    assert (section.max_turns, section.tool_timeout_s, section.max_tool_calls) == (2, 1.5, AgentLimits().max_tool_calls)
    with pytest.raises(ConfigError, match="--tool-timeout must be > 0"):
        rollout_section(p.parse_args(["--tool-timeout", "0"]))


# ---------------------------------------------------------------------- the sources' intake over the dispatcher
def _group(uid: int, record: int, rewards) -> Rollouts:
    g = len(rewards)
    return Rollouts(group_size=g, record_index=[record] * g, prompt_ids=[[1]] * g, completion_ids=[[2, 3]] * g,
                    logprobs=[[-0.5, -0.5]] * g, finish_reasons=["stop"] * g, texts=["a"] * g, prompts_text=["p"] * g,
                    rewards=np.asarray(rewards, np.float32), per_reward={}, reward_stats={}, uid=[uid] * g,
                    version_first=[0] * g, version_last=[0] * g)


def test_intake_drops_groups_without_signal_up_to_the_cap_and_reports_the_dispatchers_figures():
    d = Dispatcher(8, shuffle=False, batch_groups=2)
    intake = GroupIntake(d, DynamicSampling(True, max_drops=1), lambda ro: {})
    flat, mixed = (1.0, 1.0), (1.0, 0.0)

    def produce(step):
        lease = d.lease("local", 2)
        rewards = {0: flat, 1: flat, 2: mixed, 3: mixed}
        intake.complete(lease.id, Rollouts.concat([_group(u, r, rewards.get(u, mixed)) for u, r in
                                                  zip(lease.uids, lease.records)]))

    ro = intake.take(1, produce)
    # uid 0 has no signal and is dropped; uid 1 neither, but the cap (1 a step) is reached: it is trained as it is
    assert sorted(set(ro.uid)) == [1, 2] and intake.drops == 1
    fig = intake.figures(1, ro)
    assert fig["groups/dropped_no_signal"] == 1.0 and fig["fleet/dropped/no_signal"] == 1.0
    assert (fig["fleet/ready_groups"], fig["fleet/leased_groups"], fig["fleet/queued_groups"]) == (1.0, 0.0, 0.0)
    assert fig["fleet/staleness_max"] == 0.0 and fig["fleet/fresh_token_fraction"] == 1.0
    assert intake.commit(ro) == [1, 2] and d.counts["trained"] == 2


# ---------------------------------------------------------------------- build_rl cleans up
def test_build_rl_releases_the_run_after_a_config_error(tmp_path):
    from conftest import write_toy_task

    from posttrain.rl.setup import build_rl

    write_toy_task(tmp_path, "def reward(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    args = ["model.path=tiny:llama", f"output_dir={tmp_path / 'out'}", f"data.train={tmp_path / 'prompts.jsonl'}",
            f"rewards.functions=[{{name: {tmp_path / 'reward.py'}:reward}}]", "rewards.correctness=null"]
    with pytest.raises(ConfigError, match="group_size must be >= 2 for RLOO"):  # sections that disagree: at load
        load_config(RLConfig, None, [*args, "algorithm.preset=rloo", "rollout.group_size=1"])
    cfg = load_config(RLConfig, None, [*args, "learner.routing_replay=true"])  # an error once the trainer is built
    for _ in range(2):  # the second time, the same error: the first released the output folder's run lock
        with pytest.raises(ConfigError, match="learner.routing_replay: needs a mixture-of-experts model"):
            build_rl(cfg)


# ---------------------------------------------------------------------- no large classes on the RL path
RL_PATH = ("rl", "distill", "agent", "rollout")


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    out = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def test_no_class_on_the_rl_path_holds_more_than_15_instance_attributes():
    big = {}
    for pkg in RL_PATH:
        for f in sorted((PACKAGE / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ClassDef) and len(_instance_attributes(node)) > 15:
                    big[f"{f.relative_to(PACKAGE)}:{node.name}"] = len(_instance_attributes(node))
    assert big == {}
    from posttrain.rl.setup import RLParts

    assert len(dataclasses.fields(RLParts)) <= 15  # the parts record: frozen, and no larger than that either


# ---------------------------------------------------------------------- each concept once
def test_rl_builders_take_their_sections_and_the_steps_leave_the_parts_alone():
    """Only the run's entry points (`run_rl`, `build_rl`) take the whole `RLConfig`, the builders take their
    sections; the loop's steps assign nothing on the parts (what changes as the run goes is the loop's `RLState`),
    and the trainer is reached one way (`parts.run.trainer`)."""
    from posttrain.rl.setup import RLParts

    whole = [f"{f.name}:{fn.name}" for f in sorted((PACKAGE / "rl").glob("*.py"))
             for fn in ast.walk(ast.parse(f.read_text())) if isinstance(fn, ast.FunctionDef)
             and any(a.annotation is not None and "RLConfig" in ast.unparse(a.annotation) for a in fn.args.args)]
    assert whole == ["loop.py:run_rl", "setup.py:build_rl"], whole  # the run's entry points; every builder a section
    assert "trainer" not in {f.name for f in dataclasses.fields(RLParts)} and RLParts.__dataclass_params__.frozen
    for name in ("steps.py", "loop.py", "sources.py"):
        tree = ast.parse((PACKAGE / "rl" / name).read_text())
        written = [ast.unparse(t) for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign))
                   for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                   if ast.unparse(t).startswith("parts.")]
        assert written == [], (name, written)


def test_rollouts_per_sample_fields_are_declared_once_and_the_record_is_plain(tmp_path):
    """Selecting groups, joining them and saving them carry every per-sample field (`per_sample_fields`, read from
    the declarations); the record's module loads neither JAX nor the sampler, so the dispatcher imports it at the
    top."""
    import json
    import subprocess
    import sys

    from posttrain.rollout.rollouts import per_sample_fields

    lists = [f.name for f in dataclasses.fields(Rollouts) if str(f.type).startswith("list")]
    assert list(per_sample_fields()) == lists and len(lists) == 14
    n = 4
    values = {k: [[i] if k not in ("finish_reasons", "texts", "prompts_text", "trajectories") else
                  {"trajectories": {"turns": i}}.get(k, str(i)) for i in range(n)] for k in lists}
    values["routed_experts"] = [np.full((2, 1, 2), i, np.int8) for i in range(n)]
    ro = Rollouts(group_size=2, rewards=np.arange(n, dtype=np.float32), per_reward={}, reward_stats={}, **values)
    again = Rollouts.concat(ro.groups())
    back = Rollouts.from_json(json.loads(json.dumps(again.to_json())))
    for k in lists:
        assert [np.asarray(x).tolist() for x in getattr(back, k)] == [np.asarray(x).tolist() for x in values[k]], k
    code = ("import sys, posttrain.rollout.rollouts, posttrain.rl.dispatcher; "
            "print(sorted(m for m in ('jax', 'posttrain.sampling') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert "lazy" not in (PACKAGE / "rl" / "dispatcher.py").read_text()


def test_the_python_tools_limits_are_one_record():
    """The sandbox section extends `PythonLimits` (its keys and defaults), which every backend takes as it is."""
    from posttrain.tools.limits import PythonLimits
    from posttrain.tools.python_sandbox import SandboxConfig

    assert issubclass(SandboxConfig, PythonLimits)
    cfg = load_config(RLConfig, None, ["rollout.sandbox.memory_mb=512", "rollout.sandbox.max_output_bytes=100"])
    assert (cfg.rollout.sandbox.memory_bytes, cfg.rollout.sandbox.max_output_bytes) == (512 << 20, 100)
    with pytest.raises(ConfigError, match="rollout.sandbox.work_mb must be > 0"):
        load_config(RLConfig, None, ["rollout.sandbox.work_mb=0"])
    records = [node.name for f in (PACKAGE / "tools").rglob("*.py") for node in ast.walk(ast.parse(f.read_text()))
               if isinstance(node, ast.ClassDef) and node.name.endswith("Limits")]
    assert records == ["PythonLimits"]
