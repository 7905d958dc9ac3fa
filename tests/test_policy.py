"""`Policy` (`posttrain.rollout.policy`): a checkpoint opened once. Its samples equal the sampler's, its scores are the
learner's numbers, every kind of model spec resolves (a LoRA adapter folder merged as a hand computation says), and
the package builds a sampler and reads a vision spec only where the design says (the counts are pinned)."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

from posttrain.models.hf_io import CheckpointError, from_pretrained
from posttrain.models.spec import resolve_model
from posttrain.models.tiny import resolve_model_path
from posttrain.rollout.policy import Policy
from posttrain.rollout.prompts import PromptStyle
from posttrain.sampling import SamplingParams

PACKAGE = Path(__file__).resolve().parents[1] / "posttrain"
PARAMS = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return Path(resolve_model_path("tiny:llama", cache_dir=tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def policy(tiny) -> Policy:
    return Policy.open(tiny, max_slots=8)


def test_open_encode_sample_and_score_agree_with_the_sampler(policy):
    prompts = policy.encode(["2 plus 3 is", {"prompt": [{"role": "user", "content": "hi"}]}])
    assert prompts[0].ids == policy.tokenizer.encode("2 plus 3 is", add_special_tokens=True)
    assert prompts[1].ids == list(policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True))
    out = policy.sample(prompts, PARAMS)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, i) for p in range(2) for i in range(4)]
    assert out.trajectories is None and out.texts == [c.text for c in out]
    direct = policy.sampler.generate(prompts.ids, PARAMS)
    assert [c.token_ids for c in out] == [c.token_ids for c in direct]
    # records, strings and bare token ids are the same prompts
    assert [c.token_ids for c in policy.sample(prompts.ids, PARAMS)] == [c.token_ids for c in out]
    assert [c.token_ids for c in policy.sample(["2 plus 3 is"], PARAMS)] == [c.token_ids for c in out[:4]]
    scores = policy.score([prompts[c.prompt_index].ids for c in out], [c.token_ids for c in out])
    for c, s in zip(out, scores):
        assert s.shape == (len(c.token_ids),) and s.dtype == np.float32
        np.testing.assert_allclose(s, c.logprobs, atol=2e-5)  # the sampler's log-probs, teacher-forced


def test_score_is_the_learners_log_probs(policy):
    """The trainer's `token_logprobs` on the RL batch of the same samples (`build_rl_batch`) gives the same numbers."""
    from posttrain.rl.batch import build_rl_batch
    from posttrain.rollout.rollouts import Rollouts
    from posttrain.training.trainer import Trainer

    prompts = policy.encode(["1+1=", "a much longer prompt than the first one"])
    out = policy.sample(prompts, PARAMS)
    ids = [prompts[c.prompt_index].ids for c in out]
    n = len(out)
    ro = Rollouts(group_size=4, record_index=[c.prompt_index for c in out], prompt_ids=ids,
                  completion_ids=[c.token_ids for c in out], logprobs=[c.logprobs for c in out],
                  finish_reasons=[c.finish_reason for c in out], texts=out.texts, prompts_text=[""] * n,
                  rewards=np.zeros(n, np.float32), per_reward={}, reward_stats={})
    batch = build_rl_batch(ro, np.zeros(n, np.float32))
    trainer = Trainer(policy.model, optax.sgd(0.0), donate=False)
    learner = np.asarray(trainer.token_logprobs(batch.model_inputs(), last=batch.completion_len))
    for i, s in enumerate(policy.score(ids, ro.completion_ids)):
        np.testing.assert_allclose(s, learner[i, : len(s)], rtol=0, atol=1e-6)


def test_held_weights_swapped_weights_and_slots(tiny, policy):
    """`Policy(model, tokenizer)` samples what `Policy.open` does; `swap_weights` samples the new weights; the
    sampler's slots are sized by the policy (`sequences`), never by the caller."""
    from flax import nnx

    from posttrain.models import tokenizer as tok_lib

    held = Policy(from_pretrained(tiny), tok_lib.load(tiny), max_slots=8)
    prompts = policy.encode(["2 plus 3 is"])
    assert [c.token_ids for c in held.sample(prompts, PARAMS)] == [c.token_ids for c in policy.sample(prompts, PARAMS)]
    other = from_pretrained(tiny)
    nnx.update(other, {"norm": {"weight": nnx.state(other)["norm"]["weight"].get_value() * 3.0}})
    held.swap_weights(nnx.state(other, nnx.Param), version=7)
    assert held.version == 7 and policy.version is None
    swapped = held.sample(prompts, PARAMS)
    fresh = Policy(other, held.tokenizer, max_slots=8).sample(prompts, PARAMS)
    assert [c.token_ids for c in swapped] == [c.token_ids for c in fresh]
    assert Policy(other, held.tokenizer, max_slots=64, sequences=3).sampler.max_slots == 4
    assert Policy(other, held.tokenizer, max_slots=2, sequences=30).sampler.max_slots == 2
    held.close()
    assert held.sampler is None and held.model is None


@pytest.mark.slow
def test_run_folders_adapters_and_missing_checkpoints(tiny, tmp_path):
    """A run's folder stands for its hf/ export; a PEFT LoRA adapter folder is its base with W += (alpha / r) B A on
    the adapted layers (checked against the merged checkpoint written by hand); a missing spec is one error."""
    run = tmp_path / "run"
    shutil.copytree(tiny, run / "hf")
    assert resolve_model(run).weights == run / "hf"
    with pytest.raises(CheckpointError, match="does not exist"):
        Policy.open(tmp_path / "nothing")

    rng = np.random.default_rng(0)
    base = load_file(str(tiny / "model.safetensors"))
    hf = json.loads((tiny / "config.json").read_text())
    d, ff, r, alpha = hf["hidden_size"], hf["intermediate_size"], 2, 6.0
    adapter = {}
    shapes = {"model.layers.1.self_attn.q_proj": (d, d), "model.layers.0.mlp.down_proj": (d, ff)}
    for name, (out_dim, in_dim) in shapes.items():
        a = rng.normal(size=(r, in_dim)).astype(np.float32)
        b = rng.normal(size=(out_dim, r)).astype(np.float32) * 0.1
        adapter[f"base_model.model.{name}.lora_A.weight"], adapter[f"base_model.model.{name}.lora_B.weight"] = a, b
        base[name + ".weight"] = base[name + ".weight"] + (alpha / r) * (b @ a)
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file(adapter, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny), "peft_type": "LORA",
                                                            "r": r, "lora_alpha": alpha, "bias": "none"}))
    merged = tmp_path / "merged"
    shutil.copytree(tiny, merged)
    save_file(base, str(merged / "model.safetensors"), metadata={"format": "pt"})
    ck = resolve_model(folder)
    assert (ck.weights, ck.adapter, ck.tokenizer) == (tiny, folder, tiny)
    ids = np.asarray([[5, 9, 12, 40, 7]], np.int32)
    ours = np.asarray(Policy.open(folder, max_slots=1).model(ids))
    want = np.asarray(from_pretrained(merged)(ids))
    np.testing.assert_allclose(ours, want, atol=2e-5)
    assert not np.allclose(np.asarray(from_pretrained(tiny)(ids)), want, atol=1e-3)  # the adapter changes the logits
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny), "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        Policy.open(folder)


def test_an_agent_needs_records_and_style_is_the_policys_default(policy):
    with pytest.raises(TypeError, match="records"):
        policy.sample([[5, 6]], PARAMS, agent=object())
    chat = Policy(policy.model, policy.tokenizer, style=PromptStyle(chat=True, system_prompt="Be brief."),
                  sampler=policy.sampler)
    want = policy.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "hi"}],
                                                add_generation_prompt=True, tokenize=True)
    assert chat.encode(["hi"])[0].ids == list(want)
    assert chat.encode(["hi"], style=PromptStyle(chat=False))[0].ids == policy.encode(["hi"])[0].ids


def _calls(name: str, attribute: str | None = None) -> list[str]:
    """`path:line` of every call `name(...)` (or `name.attribute(...)`) in the package."""
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            hit = (isinstance(fn, ast.Name) and fn.id == name and attribute is None) or (
                isinstance(fn, ast.Attribute) and fn.attr == (attribute or name)
                and (attribute is None or (isinstance(fn.value, ast.Name) and fn.value.id == name)))
            if hit:
                out.append(f"{f.relative_to(PACKAGE).as_posix()}:{node.lineno}")
    return out


def test_one_sampler_and_two_vision_spec_reads_outside_sampling():
    """Who opens a checkpoint and samples: the `Policy` (and the SFT data path for its image processor)."""
    samplers = [c for c in _calls("Sampler") if not c.startswith("sampling/")]
    assert samplers == [c for c in samplers if c.startswith("rollout/policy.py:")] and len(samplers) <= 1, samplers
    vision = _calls("VisionSpec", "from_checkpoint")
    assert len(vision) <= 2 and {c.split(":")[0] for c in vision} <= {"rollout/prompts.py", "training/sft.py"}, vision


def test_the_sampling_commands_only_parse_flags():
    """`posttrain eval`, `generate` and `chat` turn flags into a run's config (or a conversation) and print: no
    function in cli/ is longer than 30 lines, and none of them opens a checkpoint itself."""
    long = []
    for f in sorted((PACKAGE / "cli").glob("*.py")):
        for fn in ast.walk(ast.parse(f.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno + 1 > 30:
                long.append(f"{f.name}:{fn.name} {fn.end_lineno - fn.lineno + 1}")
    assert long == []
    for name in ("eval.py", "generate.py", "chat.py"):  # `Policy.open` resolves and loads
        tree = ast.parse((PACKAGE / "cli" / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m.startswith(("posttrain.models", "posttrain.sampling.engine")) for m in imported), name
        assert _calls("Sampler") == [c for c in _calls("Sampler") if not c.startswith("cli/")]
