"""The Python API (`posttrain.api`, reached as `posttrain.sft`, `posttrain.rl`, ...): overrides, lazy loading, and
each function on the smoke configs' tiny models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import posttrain
from posttrain import api
from posttrain.config import ConfigError, load_config, to_dict
from posttrain.training.config import SFTConfig

REPO = Path(__file__).resolve().parents[1]


def test_import_posttrain_loads_no_jax_and_rl_stays_callable_next_to_its_subpackage():
    code = """
import sys, posttrain
assert "jax" not in sys.modules, "import posttrain loaded jax"
assert posttrain.sft is posttrain.api.sft and "jax" not in sys.modules
import posttrain.rl.config, posttrain.distill.config  # the subpackages, imported the usual way
from posttrain.rl.config import RLConfig
assert posttrain.rl.config.RLConfig is RLConfig and callable(posttrain.rl) and callable(posttrain.distill)
print(sorted(n for n in posttrain.API if not callable(getattr(posttrain, n))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_subpackage_called_runs_the_api_function(monkeypatch):
    seen = []
    monkeypatch.setattr(api, "rl", lambda *a, **k: seen.append((a, k)) or "ran")
    import posttrain.rl.config  # the subpackage is there, as after any RL import

    assert posttrain.rl("c.yaml", trainer__max_steps=1) == "ran"
    assert seen == [(("c.yaml",), {"trainer__max_steps": 1})]


def test_overrides_from_keywords_and_mappings_are_the_command_line_strings():
    got = api.override_strings({"trainer": {"max_steps": 3}, "optim.lr": 1e-3}, lora__enabled=True,
                               model__path="tiny:llama", rollout__tools=["calculator", "my.py:f"],
                               fleet__workers="2..8", eval__temperature=None)
    assert got == ["trainer.max_steps=3", "optim.lr=0.001", "lora.enabled=true", "model.path=tiny:llama",
                   'rollout.tools=["calculator", "my.py:f"]', "fleet.workers=2..8", "eval.temperature=null"]
    assert api.override_strings(["a.b=1"], c__d=2) == ["a.b=1", "c.d=2"]
    with pytest.raises(TypeError, match="key=value"):
        api.override_strings(["no_equals_sign"])


def test_a_config_mapping_loads_as_its_yaml_does(tmp_path):
    data = {"output_dir": str(tmp_path / "o"), "model": {"path": "tiny:qwen2", "param_dtype": "bfloat16"},
            "data": {"train": "x.jsonl", "format": {"format": "messages"}}, "lora": {"enabled": True, "rank": 4},
            "trainer": {"max_steps": 7, "profile": {"steps": 2}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    path, strings = api._config_and_overrides(data, {"trainer.max_steps": 9}, {"lora__rank": 2})
    from_mapping = load_config(SFTConfig, path, strings)
    from_yaml = load_config(SFTConfig, tmp_path / "c.yaml", ["trainer.max_steps=9", "lora.rank=2"])
    assert to_dict(from_mapping) == to_dict(from_yaml)
    assert (from_mapping.trainer.max_steps, from_mapping.lora.rank, from_mapping.trainer.profile.steps) == (9, 2, 2)
    with pytest.raises(ConfigError, match="trainer.max_stepz"):
        load_config(SFTConfig, *api._config_and_overrides(None, None, {"trainer__max_stepz": 1}))


def test_options_are_the_runs_config_and_unknown_ones_are_type_errors():
    from posttrain.eval.run import EvalConfig

    options = {"n": 4, "chat": True, "k": [1, 4], "max_new_tokens": 8, "tools": "calculator"}
    api._check_options(EvalConfig, "evaluate", options)
    cfg = EvalConfig(model="m", data="d.jsonl", **options)
    assert (cfg.n, cfg.chat, cfg.k, cfg.max_new_tokens, cfg.tools) == (4, True, [1, 4], 8, "calculator")
    assert EvalConfig(n=8, k="1,2").k == [1, 2] and EvalConfig(n=6).k == [1, 2, 4, 6]
    assert EvalConfig().chat is None and EvalConfig(chat=False).chat is False  # unset: the model's own prompt format
    with pytest.raises(TypeError, match="unknown option 'nonsense'"):
        api.evaluate("m", "d.jsonl", nonsense=1)
    with pytest.raises(ConfigError, match="--k"):
        api.evaluate("m", "d.jsonl", n=2, k=[3])


def test_bad_input_is_a_typed_error_naming_the_file(tmp_path):
    """The runs raise the package's errors (never SystemExit, never text read back from stderr), before any model
    loads."""
    from posttrain.data.errors import DataError

    with pytest.raises(DataError, match=str(tmp_path / "missing.jsonl")):
        posttrain.generate("tiny:llama", tmp_path / "missing.jsonl", tmp_path / "out.jsonl")
    with pytest.raises(DataError, match=str(tmp_path / "missing.jsonl")):
        posttrain.evaluate("tiny:llama", tmp_path / "missing.jsonl")


def test_the_api_reaches_no_cli_module():
    text = (REPO / "posttrain" / "api.py").read_text()
    assert "posttrain.cli" not in text and "importlib" not in text and "argv" not in text


@pytest.mark.slow
def test_sft_then_evaluate_and_generate_on_the_smoke_config(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the smoke config names its data relative to the checkout
    res = posttrain.sft("configs/sft_smoke.yaml", output_dir=tmp_path / "sft", trainer__max_steps=4,
                        overrides={"trainer.log_every": 2, "trainer.eval_every": 4, "trainer.progress": False})
    assert res.command == "sft" and res.output_dir == tmp_path / "sft"
    assert (res.hf_dir / "config.json").exists() and res.config_path.exists()
    assert res.metrics["step"] == 4 and "loss" in res.metrics and "eval_loss" in res.metrics
    steps = [s for s, _ in res.history("loss")]
    assert steps == sorted(steps) and {2, 4} <= set(steps)  # every log_every steps (and the first, logged too)
    assert res.summary.final_step == 4

    ev = posttrain.evaluate(res.output_dir, "tests/data/rl_prompts_tiny.jsonl", n=2, limit=3, max_new_tokens=8,
                            chat=True, reward_workers=0, no_progress=True, output=tmp_path / "eval.jsonl")
    assert ev.summary_path == tmp_path / "eval.summary.json"
    assert ev.metrics["eval/num_prompts"] == 3 and 0.0 <= ev.metrics["eval/accuracy"] <= 1.0
    assert "eval/pass@2" in ev.metrics and len(ev.problems()) == 3

    gen = posttrain.generate(res.hf_dir, ["1+2=", {"messages": [{"role": "user", "content": "3+4="}]}],
                             tmp_path / "gen.jsonl", max_new_tokens=5, n=2, temperature=0, no_progress=True)
    assert len(gen.completions) == 4 and gen.completions == [json.loads(x) for x in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert sorted((c["prompt_index"], c["sample_index"]) for c in gen.completions) == [(0, 0), (0, 1), (1, 0),
                                                                                       (1, 1)]


@pytest.mark.slow
def test_rl_dpo_and_distill_return_their_outputs(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    quiet = {"trainer.progress": False}
    rl = posttrain.rl("configs/rl_smoke.yaml", output_dir=tmp_path / "rl", trainer__max_steps=2, eval__at_start=False,
                      overrides=quiet)
    assert rl.command == "rl" and rl.hf_dir is not None and rl.metrics["step"] == 2
    assert "reward/mean" in rl.metrics and len(rl.history("reward/mean")) == 2
    assert "eval/accuracy" in rl.metrics  # the held-out evaluation at the end

    dpo = posttrain.dpo("configs/dpo_smoke.yaml", output_dir=tmp_path / "dpo", trainer__max_steps=2, overrides=quiet)
    assert dpo.hf_dir is not None and "rewards/margins" in dpo.metrics

    distill = posttrain.distill("configs/distill_smoke.yaml", output_dir=tmp_path / "distill", trainer__max_steps=2,
                               trainer__eval_every=0, overrides=quiet)
    assert distill.hf_dir is not None and distill.summary.startswith("distill (logit): done at step 2")
    # each export records how its data prompted the model: rl_smoke's `data.chat`, dpo_smoke's text pairs,
    # distill_smoke's `messages`
    from posttrain.models.prompt_format import PromptStyle, read_prompt_style

    assert [read_prompt_style(r.hf_dir) for r in (rl, dpo, distill)] == [PromptStyle(chat=True),
                                                                        PromptStyle(chat=False), PromptStyle(chat=True)]
