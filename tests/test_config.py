"""Tests for posttrain.config: YAML + dotted overrides -> typed dataclass trees, errors, round trip."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

import pytest

from posttrain.config import ConfigError, config_from_argv, load_config, save_config, to_dict


@dataclass
class ModelCfg:
    path: str
    dtype: Literal["float32", "bfloat16"] = "bfloat16"


@dataclass
class TrainerCfg:
    max_steps: int = 100
    seed: int = 0
    output_dir: Optional[str] = None
    use_lora: bool = False


@dataclass
class OptimCfg:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class RewardCfg:
    name: str
    weight: float = 1.0


@dataclass
class Cfg:
    model: ModelCfg
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    rewards: list[RewardCfg] = field(default_factory=list)
    tags: dict[str, int] = field(default_factory=dict)
    data: Optional[str] = None


YAML = """\
model:
  path: /models/tiny
trainer:
  max_steps: 50
optim:
  lr: 3e-4
rewards:
  - name: exact
  - name: format
    weight: 0.5
tags:
  a: 1
"""


@pytest.fixture
def yaml_path(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(YAML)
    return p


def test_yaml_and_defaults(yaml_path):
    cfg = load_config(Cfg, yaml_path, [])
    assert cfg.model == ModelCfg(path="/models/tiny", dtype="bfloat16")
    assert cfg.trainer == TrainerCfg(max_steps=50)
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.rewards == [RewardCfg("exact", 1.0), RewardCfg("format", 0.5)]
    assert cfg.tags == {"a": 1}


def test_overrides(yaml_path):
    cfg = load_config(Cfg, yaml_path, [
        "model.path=/other", "trainer.max_steps=10", "optim.lr=1e-4", "data=train.jsonl",
        "trainer.use_lora=true", "optim.betas=[0.8, 0.9]", "rewards.1.weight=2", "tags.b=3",
        "trainer.output_dir=null", "model.dtype=float32"])
    assert cfg.model == ModelCfg("/other", "float32")
    assert cfg.trainer == TrainerCfg(max_steps=10, use_lora=True, output_dir=None)
    assert cfg.optim.lr == 1e-4 and cfg.optim.betas == [0.8, 0.9]
    assert cfg.rewards[1] == RewardCfg("format", 2.0)
    assert isinstance(cfg.rewards[1].weight, float)
    assert cfg.tags == {"a": 1, "b": 3}
    assert cfg.data == "train.jsonl"


def test_no_file_defaults_and_str_keeps_raw_text():
    cfg = load_config(Cfg, None, ["model.path=0123", "optim.lr=1"])
    assert cfg.model.path == "0123"  # a str field takes the override text verbatim
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.trainer == TrainerCfg()


def test_unknown_key_lists_valid_keys(yaml_path):
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, yaml_path, ["trainer.max_stepz=3"])
    msg = str(e.value)
    assert "'trainer.max_stepz'" in msg
    for k in ("max_steps", "seed", "output_dir", "use_lora"):
        assert k in msg
    with pytest.raises(ConfigError, match=r"'rewards\[0\]\.wieght'.*name, weight"):
        load_config(Cfg, None, ["model.path=x", "rewards=[{name: a, wieght: 1}]"])
    with pytest.raises(ConfigError, match="'bogus'.*model, trainer, optim, rewards, tags, data"):
        load_config(Cfg, None, ["model.path=x", "bogus=1"])


@pytest.mark.parametrize("override, needles", [
    ("trainer.max_steps=abc", ["trainer.max_steps", "int", "abc"]),
    ("trainer.max_steps=1.5", ["trainer.max_steps", "int", "1.5"]),
    ("trainer.use_lora=3", ["trainer.use_lora", "bool", "3"]),
    ("optim.lr=fast", ["optim.lr", "float", "fast"]),
    ("optim.betas=0.9", ["optim.betas", "list", "0.9"]),
    ("optim.betas=[0.9, x]", ["optim.betas[1]", "float", "x"]),
    ("tags.a=one", ["tags.a", "int", "one"]),
    ("trainer.output_dir=[1]", ["trainer.output_dir", "str | None"]),
    ("trainer=5", ["trainer", "TrainerCfg", "5"]),
])
def test_bad_types(override, needles):
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, None, ["model.path=x", override])
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_bad_literal_lists_accepted_values():
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, None, ["model.path=x", "model.dtype=fp8"])
    msg = str(e.value)
    assert "model.dtype" in msg and "fp8" in msg and "'float32'" in msg and "'bfloat16'" in msg


def test_missing_required_named():
    with pytest.raises(ConfigError, match="'model.path'"):
        load_config(Cfg, None, [])
    with pytest.raises(ConfigError, match=r"'rewards\[0\].name'"):
        load_config(Cfg, None, ["model.path=x", "rewards=[{weight: 1}]"])


def test_yaml_error_names_file_and_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("model:\n  path: x\n  dtype: [unclosed\ntrainer:\n  max_steps: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, p, [])
    msg = str(e.value)
    assert str(p) in msg
    assert "line 4" in msg  # the error is detected where the flow sequence should have closed
    p2 = tmp_path / "tab.yaml"
    p2.write_text("model:\n  path: x\n\tbad: 1\n")
    with pytest.raises(ConfigError, match=r"tab\.yaml:3:"):
        load_config(Cfg, p2, [])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(Cfg, None, ["model.path"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, tmp_path / "nope.yaml", [])


def test_round_trip(yaml_path, tmp_path):
    cfg = load_config(Cfg, yaml_path, ["trainer.seed=7", "optim.lr=2.5e-5", "data=d.jsonl"])
    out = tmp_path / "out" / "config.yaml"
    save_config(cfg, out)
    assert load_config(Cfg, out, []) == cfg
    d = to_dict(cfg)
    assert d["rewards"] == [{"name": "exact", "weight": 1.0}, {"name": "format", "weight": 0.5}]
    assert d["optim"]["lr"] == 2.5e-5


def test_config_from_argv(yaml_path):
    cfg = config_from_argv(Cfg, ["--config", str(yaml_path), "trainer.max_steps=2"])
    assert cfg.trainer.max_steps == 2 and cfg.model.path == "/models/tiny"


def test_post_init_errors_become_config_errors():
    @dataclass
    class Checked:
        n: int = 1

        def __post_init__(self):
            if self.n < 0:
                raise ValueError("n must be >= 0")

    @dataclass
    class Outer:
        inner: Checked = field(default_factory=Checked)

    with pytest.raises(ConfigError, match="inner.*n must be >= 0"):
        load_config(Outer, None, ["inner.n=-1"])


# ---------------------------------------------------------------------- the shipped configs
SHIPPED = {"sft_smoke.yaml": "sft", "rl_moe_smoke.yaml": "rl", "sft_moe_smoke.yaml": "sft", "dpo_moe_smoke.yaml": "dpo", "sft_qwen2.5_0.5b.yaml": "sft", "rl_smoke.yaml": "rl", "gsm8k_grpo.yaml": "rl",
           "smollm2_rl_cpu.yaml": "rl", "dpo_smoke.yaml": "dpo", "dpo_qwen2.5_0.5b.yaml": "dpo",
           "distill_smoke.yaml": "distill", "distill_qwen2.5.yaml": "distill", "vlm_smoke.yaml": "sft",
           "vlm_gemma3_4b.yaml": "sft", "vlm_rl_smoke.yaml": "rl", "agent_gsm8k_python.yaml": "rl",
           "agent_chain_sum_calculator.yaml": "rl", "rl_verifiers_smoke.yaml": "rl"}
NOT_RUN_HERE = {"vlm_gemma3_4b.yaml"}  # its data files are documented placeholders (no image-QA set offline)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_parses_and_validates(name, tmp_path):
    """Each configs/*.yaml loads into its typed config, round-trips, and passes the checks a run makes first:
    a valid model numerics section, batch splits, local data files present, rewards resolvable with the
    data's fields."""
    from pathlib import Path

    from posttrain.models.config import llama_like
    from posttrain.rewards.runner import RewardRunner, RewardSpec
    from posttrain.rl.loop import load_rl_config
    from posttrain.training.dpo import load_dpo_config
    from posttrain.training.sft import load_sft_config

    root = Path(__file__).resolve().parents[1]
    assert sorted(p.name for p in (root / "configs").glob("*.yaml")) == sorted(SHIPPED)  # new ones get a kind
    from posttrain.distill.run import load_distill_config

    load = {"sft": load_sft_config, "rl": load_rl_config, "dpo": load_dpo_config,
            "distill": load_distill_config}[SHIPPED[name]]
    cfg = load(root / "configs" / name)
    save_config(cfg, tmp_path / name)
    assert load(tmp_path / name) == cfg
    m = cfg.model
    llama_like(param_dtype=m.param_dtype, compute_dtype=m.compute_dtype or m.param_dtype, remat=m.remat)
    for f in (cfg.data.train, cfg.data.eval):
        if f and f.endswith(".jsonl") and name not in NOT_RUN_HERE:  # local files, from the repository root
            assert (root / f).is_file() or f.startswith("../shared/"), f
    if SHIPPED[name] == "distill":  # both modes' data, the loss settings, the on-policy batch split
        from posttrain.algorithms.distill import make_token_loss

        make_token_loss(cfg.loss.kind, cfg.loss.beta, cfg.loss.temperature, cfg.loss.alpha)
        assert cfg.teacher.path and cfg.data.batch_size % cfg.trainer.grad_accum == 0
        cfg = cfg.rl_config()
        for f in (cfg.data.train, cfg.data.eval):
            assert not f or (root / f).is_file() or f.startswith("../shared/"), f
    if SHIPPED[name] in ("sft", "dpo"):
        assert cfg.data.batch_size % cfg.trainer.grad_accum == 0
        if SHIPPED[name] == "dpo":
            cfg.algorithm.resolved()  # the loss preset takes the settings given
        return
    n = cfg.rollout.batch_prompts * cfg.rollout.group_size  # the rollouts of one step
    assert n % cfg.learner.minibatches == 0 and (n // cfg.learner.minibatches) % cfg.trainer.grad_accum == 0
    assert cfg.algorithm.advantage in ("grpo", "dr_grpo", "rloo")
    runner = RewardRunner([RewardSpec.coerce(r.name) for r in cfg.rewards.functions], num_workers=0)
    fields = {"prompt", "answer"}
    if cfg.data.train.startswith("reasoning_gym:"):  # generated offline: the records' own fields
        from posttrain.data import read_prompts

        fields = set(read_prompts(cfg.data.train)[0])
    if cfg.rollout.multi_turn:  # the tools and environment load; rewards may read the conversation
        from posttrain.agent.setup import load_agent_parts

        tools, env = load_agent_parts(cfg.rollout)
        fields |= {"messages"}
    runner.check_fields(fields | {"completion_lengths"})
    own = ["environment"] * bool(cfg.rollout.environment)
    own += ["rubric"] * (name == "rl_verifiers_smoke.yaml")  # its verifiers environment is named on the command line
    assert cfg.rewards.correctness in [r.name for r in cfg.rewards.functions] + own + [None] * (SHIPPED[name] == "distill")
    runner.close()


def test_a_section_given_in_part_keeps_its_fields_defaults():
    """A section whose field has its own default (RL's optim: lr 1e-6, constant) keeps that default for the keys
    a YAML file or override does not give, not the section class's (OptimConfig: lr 1e-4, cosine)."""
    from posttrain.distill.config import DistillConfig
    from posttrain.rl.config import RLConfig

    cfg = load_config(RLConfig, None, ["optim.warmup_steps=3"])
    assert (cfg.optim.lr, cfg.optim.decay, cfg.optim.warmup_steps) == (1e-6, "constant", 3)
    d = load_config(DistillConfig, None, ["on_policy.rollout.batch_prompts=4"])
    assert (d.on_policy.rollout.group_size, d.on_policy.rollout.batch_prompts, d.on_policy.rewards.functions) == (1, 4, [])


# ---------------------------------------------------------------------- annotations of every kind
class Color(__import__("enum").Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Kinds:
    pair: tuple[int, str] = (1, "a")
    many: tuple[float, ...] = ()
    where: "Path | None" = None
    color: Color = Color.RED
    num: "int | str" = 0
    seq: "Sequence[int]" = field(default_factory=list)


def test_every_kind_of_annotation():
    """Tuples (fixed and any length), Path, Enum (value or name), unions (an int stays an int before str),
    Sequence: converted, and each wrong value named with its dotted key and what was expected."""
    cfg = load_config(Kinds, None, ["pair=[2, b]", "many=[1, 2.5]", "where=/tmp/x", "color=BLUE", "num=7", "seq=[3]"])
    assert cfg == Kinds(pair=(2, "b"), many=(1.0, 2.5), where=Path("/tmp/x"), color=Color.BLUE, num=7, seq=[3])
    assert load_config(Kinds, None, ["color=blue", "num=x7"]).num == "x7"
    for override, needles in [("pair=[1]", ["'pair'", "tuple[int, str]", "(expected 2 items)"]),
                              ("many=[1, x]", ["'many[1]'", "float", "'x'"]),
                              ("color=green", ["'color'", "invalid value 'green'", "'red', 'blue'"]),
                              ("where=[1]", ["'where'", "Path | None"]),
                              ("seq=3", ["'seq'", "Sequence[int]", "3 (int)"])]:
        with pytest.raises(ConfigError) as e:
            load_config(Kinds, None, [override])
        assert all(n in str(e.value) for n in needles), (override, str(e.value))


# ---------------------------------------------------------------------- the run configs
def _run_kinds():
    from posttrain.distill.config import DistillConfig
    from posttrain.rl.config import RLConfig
    from posttrain.training.config import SFTConfig
    from posttrain.training.dpo import DPOConfig

    return {"sft": SFTConfig, "dpo": DPOConfig, "rl": RLConfig, "distill": DistillConfig}


@pytest.mark.parametrize("kind, lr, decay, log_every, save_every", [
    ("sft", 1e-4, "cosine", 10, 100), ("dpo", 5e-6, "cosine", 10, 100), ("rl", 1e-6, "constant", 1, 50),
    ("distill", 1e-4, "cosine", 10, 100)])
def test_each_run_kind_keeps_its_defaults_in_a_partial_section(kind, lr, decay, log_every, save_every, tmp_path):
    """Every run config is a RunConfig (the shared sections declared once); a shared section given in part, by
    an override or in a YAML file, keeps that run kind's defaults for the other keys."""
    from posttrain.training.config import RunConfig

    cls = _run_kinds()[kind]
    assert issubclass(cls, RunConfig)
    cfg = load_config(cls, None, [])
    assert cfg.output_dir == f"outputs/{kind}"
    assert (cfg.optim.lr, cfg.optim.decay, cfg.trainer.log_every, cfg.trainer.save_every) == (lr, decay, log_every,
                                                                                           save_every)
    p = tmp_path / "part.yaml"
    p.write_text("optim:\n  warmup_steps: 3\ntrainer:\n  max_steps: 7\n")
    for cfg in (load_config(cls, p, []), load_config(cls, None, ["optim.warmup_steps=3", "trainer.max_steps=7"])):
        assert (cfg.optim.lr, cfg.optim.decay, cfg.optim.warmup_steps) == (lr, decay, 3)
        assert (cfg.trainer.log_every, cfg.trainer.save_every, cfg.trainer.max_steps) == (log_every, save_every, 7)


def test_learner_keys_moved_out_of_the_algorithm():
    """The algorithm section holds the preset's settings only; an old config's learner key is a one-line error
    naming the new key."""
    import dataclasses

    from posttrain.algorithms.registry import GRPOFamily
    from posttrain.rl.config import LearnerConfig, RLConfig

    assert not {f.name for f in dataclasses.fields(GRPOFamily)} & {f.name for f in dataclasses.fields(LearnerConfig)}
    cfg = load_config(RLConfig, None, ["learner.ppo_epochs=2", "learner.is_level=none", "algorithm.beta=0.1"])
    assert cfg.learner == LearnerConfig(ppo_epochs=2, is_level="none") and cfg.algorithm.beta == 0.1
    assert isinstance(cfg.algorithm, GRPOFamily)
    learner_keys = {f.name for f in dataclasses.fields(LearnerConfig)}
    added = {"routing_replay", "is_mode", "is_low", "rejection", "rejection_low", "rejection_high"}  # after the move
    assert set(GRPOFamily.MOVED_KEYS) == learner_keys - added
    for key in ("ppo_epochs", "minibatches", "old_logprobs", "is_level", "is_cap", "max_resample_rounds"):
        with pytest.raises(ConfigError) as e:
            load_config(RLConfig, None, [f"algorithm.{key}=2"])
        assert str(e.value) == f"config key algorithm.{key} moved to learner.{key}"
    with pytest.raises(ConfigError, match="learner.ppo_epochs must be >= 1, found 0"):
        load_config(RLConfig, None, ["learner.ppo_epochs=0"])


def test_distill_rl_config_takes_the_shared_sections():
    """On-policy distillation's RL run has the distillation's shared sections (not RL's defaults) and its own
    prompts, rollout, rewards and evaluation."""
    from posttrain.distill.config import DistillConfig
    from posttrain.training.config import RunConfig

    d = load_config(DistillConfig, None, ["optim.warmup_steps=2", "lora.enabled=true", "trainer.max_steps=3",
                                          "output_dir=/tmp/d", "export_dtype=bfloat16", "mesh.fsdp=2",
                                          "on_policy.prompts.train=p.jsonl", "on_policy.rollout.group_size=2"])
    rl = d.rl_config()
    import dataclasses

    for f in dataclasses.fields(RunConfig):
        assert getattr(rl, f.name) == getattr(d, f.name), f.name
    assert rl.optim.lr == 1e-4 and rl.data.train == "p.jsonl" and rl.rollout.group_size == 2
    assert (rl.algorithm.beta, rl.algorithm.aggregation, rl.learner.ppo_epochs) == (0.0, "token_mean", 1)
