"""Training a mixture of experts: the router terms of the SFT, DPO and RL losses (load-balancing loss as transformers
adds it, router z-loss, moe/* metrics, routing replay in the RL loss), `posttrain sft` / `dpo` on `tiny:qwen3_moe`
through the CLI, and `posttrain info` on it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from posttrain.algorithms.sft import sft_loss
from posttrain.models import from_pretrained
from posttrain.models.moe_loss import RouterLoss, load_balancing_loss, router_z_loss
from posttrain.models.tiny import resolve_model_path
from posttrain.rl.batch import RLBatch

REPO = Path(__file__).resolve().parents[1]
MOE_METRICS = {"moe/aux_loss", "moe/z_loss", "moe/load_max", "moe/router_entropy"}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return resolve_model_path("tiny:qwen3_moe", cache_dir=tmp_path_factory.mktemp("tiny"))


def _batch(vocab, rows=4, width=10, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(rows, width))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :2] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.full_optimization
def test_sft_loss_adds_the_aux_loss_as_transformers_does(tmp_path):
    """Qwen3-MoE (a dense layer, two sparse) with router_aux_loss_coef=0.05: our SFT loss equals transformers'
    `loss` (cross-entropy + coef * load_balancing_loss_func over the attention mask, output_router_logits=True), and
    moe/aux_loss its `aux_loss`."""
    import torch
    import transformers
    from test_moe_parity import build_hf

    build_hf("qwen3_moe").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": 0.05}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, mask = _batch(96)
    loss_mask = mask.copy()
    loss_mask[:, :6] = 0  # a prompt (each row's first target predicted from a real token)
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos),
                 labels=torch.tensor(np.where(loss_mask > 0, ids, -100)), output_router_logits=True)
    model = from_pretrained(tmp_path)
    assert model.cfg.router_aux_loss_coef == 0.05
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
    loss_sum, count, metrics = jax.jit(lambda b: sft_loss(model, b))(batch)
    np.testing.assert_allclose(float(loss_sum / count), float(out.loss), rtol=1e-5)
    aux_num, aux_den = metrics["moe/aux_loss"]
    np.testing.assert_allclose(float(aux_num / aux_den), float(out.aux_loss), rtol=1e-5)
    assert MOE_METRICS <= set(metrics)


@pytest.mark.slow
def test_router_loss_coefficients(tiny_moe):
    """moe.aux_loss_coef=0 and moe.z_loss_coef=c: the loss grows by c * z-loss per target token, z-loss over the
    real tokens of the pass's router logits; the aux loss weighs the checkpoint's coefficient when unset."""
    model = from_pretrained(tiny_moe)
    ids, mask = _batch(model.cfg.vocab_size)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    run = jax.jit(lambda b, aux, z: sft_loss(model, b, router=RouterLoss(aux, z)), static_argnums=(1, 2))
    plain, count, _ = run(batch, 0.0, 0.0)
    with_z, _, metrics = run(batch, 0.0, 0.1)
    routing = model(ids, attention_mask=mask, routing=True)[1]
    z = float(router_z_loss(routing.logits, mask.reshape(-1)))
    np.testing.assert_allclose(float(with_z - plain), 0.1 * z * float(count), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["moe/z_loss"][0] / metrics["moe/z_loss"][1]), z, rtol=1e-5)
    default, _, m = run(batch, None, 0.0)
    aux = float(load_balancing_loss(routing.logits, 2, mask.reshape(-1)))
    np.testing.assert_allclose(float(m["moe/aux_loss"][0] / count), aux, rtol=1e-5)
    coef = model.cfg.router_aux_loss_coef
    assert coef > 0
    np.testing.assert_allclose(float(default - plain), coef * aux * float(count), rtol=1e-3)


def test_dpo_loss_reports_router_metrics(tiny_moe):
    from posttrain.algorithms.preference import DPO, make_preference_loss

    model = from_pretrained(tiny_moe)
    ids, mask = _batch(model.cfg.vocab_size)
    loss_mask = mask.copy()
    loss_mask[:, :5] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
             "ref_logps": np.full(4, -30.0, np.float32)}
    loss = make_preference_loss(DPO(), reference="precomputed", router=RouterLoss(0.0, 0.0))
    _, pairs, metrics = jax.jit(lambda b: loss(model, b, {}))(batch)
    routing = model(ids, attention_mask=mask, routing=True)[1]
    aux = float(load_balancing_loss(routing.logits, 2, mask.reshape(-1)))
    assert MOE_METRICS <= set(metrics)
    np.testing.assert_allclose(float(metrics["moe/aux_loss"][0] / pairs), aux, rtol=1e-5)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplayBatch(RLBatch):
    """An RL batch with the sampler's recorded experts (the field `posttrain.rl.loss.routed_experts` reads)."""

    routed_experts: np.ndarray | None = None


def _rl_batch(model, ids, mask, completion: int, replay=None):
    """A padded RL batch over (ids, mask) whose last `completion` columns are the completion, its behaviour log-probs
    the model's own; with `replay`, a `ReplayBatch`."""
    from posttrain.rl.loss import padded_logprobs

    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    fields = {"input_ids": ids, "attention_mask": mask, "positions": pos, "loss_mask": np.ones((len(ids), completion)),
              "advantages": np.linspace(-1, 1, len(ids)).astype(np.float32),
              "behaviour_logp": np.zeros((len(ids), completion), np.float32)}
    behaviour = np.asarray(padded_logprobs(model, RLBatch(**fields))[0])
    fields["behaviour_logp"] = behaviour
    return RLBatch(**fields) if replay is None else ReplayBatch(**fields, routed_experts=replay)


@pytest.mark.slow
def test_rl_loss_router_metrics_and_replay(tiny_moe):
    """The RL loss reports moe/*; a batch with `routed_experts` replays them: the model's own choices give the same
    loss and agreement 1, other experts change the loss and lower the agreement."""
    from posttrain.rl.loss import make_rl_loss

    model = from_pretrained(tiny_moe)
    ids, mask = _batch(model.cfg.vocab_size)
    own = np.asarray(model(ids, attention_mask=mask, routing=True)[1].experts)
    loss = jax.jit(lambda b: make_rl_loss({})(model, b))
    plain, w, metrics = loss(_rl_batch(model, ids, mask, 4))
    assert MOE_METRICS <= set(metrics) and "moe/router_agreement" not in metrics
    same, _, m_same = loss(_rl_batch(model, ids, mask, 4, replay=own))
    np.testing.assert_allclose(float(same), float(plain), rtol=1e-6)
    assert float(m_same["moe/router_agreement"][0] / w) == 1.0
    other = own.copy()
    for b, t in np.ndindex(len(ids), 5):  # layer 0 of the last 5 columns: the two experts the router did not choose
        other[b, 5 + t, 0] = sorted(set(range(4)) - set(own[b, 5 + t, 0].tolist()))
    changed, _, m_other = loss(_rl_batch(model, ids, mask, 4, replay=other))
    assert abs(float(changed) - float(plain)) > 1e-6
    agreement = float(m_other["moe/router_agreement"][0] / w)
    assert 0.0 < agreement < 1.0


# ---------------------------------------------------------------------- the CLI
def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


# measured on 2 shared cores: sft 19 s (slow: with the machine's drift, over 20 s), dpo 13 s
@pytest.mark.parametrize("command", [pytest.param("sft", marks=pytest.mark.slow), "dpo"])
@pytest.mark.slow
def test_training_commands_on_tiny_qwen3_moe(command, tmp_path, monkeypatch):
    from posttrain.cli.main import main

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "tiny"))
    out = tmp_path / "out"
    code = main(["--no-compile-cache", command, f"configs/{command}_moe_smoke.yaml", f"output_dir={out}",
                 "trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=2", "trainer.eval_batches=1",
                 "trainer.save_every=2", "trainer.progress=false"])
    assert code == 0
    rows = _metrics(out)
    steps = [r for r in rows if "loss" in r]
    assert steps and all(MOE_METRICS <= set(r) for r in steps), rows
    assert all(np.isfinite(r["moe/aux_loss"]) and 0 < r["moe/load_max"] <= 1 for r in steps)
    assert (out / "hf" / "config.json").is_file()
    assert json.loads((out / "hf" / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_info_shows_experts_and_active_parameters(tmp_path, monkeypatch, capsys):
    from posttrain.cli.main import main

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["info", "tiny:qwen3_moe"]) == 0
    text = capsys.readouterr().out
    assert "4 x 96, top-2 (renormalised)" in text and "expert layers" in text
    assert "active parameters" in text and "112,512" in text and "of 186,240 per token" in text
