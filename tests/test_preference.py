"""The DPO family: every loss against hand-computed values, presets, data formats and errors, micro-batching,
and DPO / ORPO losses, log-probs and gradients against TRL 1.16 on the same tiny model and batch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.algorithms import preference as P
from posttrain.config import ConfigError
from posttrain.data.preference import PreferenceFormat, encode_pair, encode_pairs
from posttrain.data.sources import DataError, read_records

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- the losses, by hand
C, R = [-5.0, -8.0, -3.0], [-6.0, -7.0, -9.0]  # policy log π(y_w|x), log π(y_l|x)
RC, RR = [-5.5, -7.0, -4.0], [-5.8, -7.5, -8.0]  # reference
LC, LR = [2.0, 4.0, 3.0], [3.0, 2.0, 5.0]  # response lengths


def _pairs():
    a = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return P.PairLogps(a(C), a(R), a(LC), a(LR), a(RC), a(RR))


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def _h(i):
    return (C[i] - RC[i]) - (R[i] - RR[i])


HAND = {
    "sigmoid": lambda i, b: -math.log(_sig(b * _h(i))),
    "hinge": lambda i, b: max(0.0, 1.0 - b * _h(i)),
    "ipo": lambda i, b: ((C[i] - RC[i]) / LC[i] - (R[i] - RR[i]) / LR[i] - 1.0 / (2 * b)) ** 2,
    "robust": lambda i, b, e=0.2: ((1 - e) * -math.log(_sig(b * _h(i))) - e * -math.log(_sig(-b * _h(i)))) / (1 - 2 * e),
    "cdpo": lambda i, b, e=0.2: -(1 - e) * math.log(_sig(b * _h(i))) - e * math.log(_sig(-b * _h(i))),
    "simpo": lambda i, b, g=0.7: -math.log(_sig(b * C[i] / LC[i] - b * R[i] / LR[i] - g)),
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_loss_matches_hand_computed_values(name):
    kw = {"label_smoothing": 0.2} if name in ("robust", "cdpo") else {"gamma": 0.7} if name == "simpo" else {}
    beta = 0.5
    spec = P.make_preset(name, beta=beta, **kw)
    got = np.asarray(spec.losses(_pairs()))
    want = [HAND[name](i, beta) for i in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_orpo_odds_ratio_by_hand():
    beta = 0.25
    got = np.asarray(P.make_preset("orpo", beta=beta).losses(_pairs()))
    for i in range(3):
        pw, pl = math.exp(C[i] / LC[i]), math.exp(R[i] / LR[i])
        log_or = math.log(pw / (1 - pw)) - math.log(pl / (1 - pl))
        assert got[i] == pytest.approx(-beta * math.log(_sig(log_or)), rel=1e-5)
    # log1mexp stays accurate at both ends (where log(1 - exp(x)) in float32 gives -inf or 0)
    x = jnp.asarray([-1e-6, -0.5, -0.7, -30.0], jnp.float32)
    np.testing.assert_allclose(np.asarray(P.log1mexp(x)), [math.log(-math.expm1(float(v))) for v in x], rtol=1e-3)


def test_rewards_and_presets():
    p = _pairs()
    rc, rr = P.make_preset("sigmoid", beta=0.5).rewards(p)
    np.testing.assert_allclose(np.asarray(rc), [0.5 * (C[i] - RC[i]) for i in range(3)], rtol=1e-6)
    rc, _ = P.make_preset("simpo").rewards(p)  # reference-free: beta x mean log-prob
    np.testing.assert_allclose(np.asarray(rc), [2.0 * C[i] / LC[i] for i in range(3)], rtol=1e-6)
    # one source of truth for defaults: the preset classes
    assert P.make_preset("simpo") == P.SimPO(beta=2.0, gamma=1.0)
    assert P.make_preset("robust").label_smoothing == 0.1
    with pytest.raises(ValueError, match=r"algorithm.gamma does not apply to loss 'sigmoid' \(it takes: beta\)"):
        P.make_preset("sigmoid", gamma=1.0)
    with pytest.raises(ValueError, match="unknown preference loss 'dpo2'; accepted: .*'orpo'"):
        P.make_preset("dpo2")
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        P.make_preset("robust", label_smoothing=0.5)


def test_dpo_config_is_typed_and_checked(tmp_path):
    from posttrain.training.dpo import DPOConfig, load_dpo_config

    cfg = load_dpo_config(ROOT / "configs" / "dpo_smoke.yaml", ["algorithm.loss=simpo", "algorithm.gamma=0.5"])
    assert isinstance(cfg, DPOConfig) and cfg.algorithm.resolved() == P.SimPO(beta=0.1, gamma=0.5)
    with pytest.raises(ConfigError, match="algorithm.gama.*valid keys.*gamma"):
        load_dpo_config(None, ["algorithm.gama=0.5"])
    with pytest.raises(ConfigError, match="algorithm.loss"):
        load_dpo_config(None, ["algorithm.loss=kto"])
    with pytest.raises(ConfigError, match="does not apply to loss 'ipo'"):
        load_dpo_config(None, ["algorithm.loss=ipo", "algorithm.label_smoothing=0.1"]).algorithm.resolved()


# ---------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def tok():
    from posttrain.models import tokenizer as tokenizer_lib
    from posttrain.models.tiny import resolve_model_path

    return tokenizer_lib.load(resolve_model_path("tiny:llama"))


def _resp(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids, mask) if m])


def test_formats_explicit_implicit_text_and_conversation(tok):
    fmt = PreferenceFormat()
    eos = tok.decode([tok.eos_token_id])
    (ci, cm), (ri, rm) = encode_pair({"prompt": "1+2=", "chosen": "3", "rejected": "4"}, tok, fmt, "x")
    assert _resp(tok, ci, cm) == "3" + eos and _resp(tok, ri, rm) == "4" + eos
    assert tok.decode(ci[: len(ci) - 2]).endswith("1+2=")
    # implicit prompt (text): the common prefix, cut before the differing word's space
    (ci2, cm2), (_, rm2) = encode_pair({"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"}, tok, fmt, "x")
    assert _resp(tok, ci2, cm2) == " blue" + eos
    # conversations: explicit and implicit prompt give the same rows, masks on the assistant reply only
    user = [{"role": "user", "content": "1+2="}]
    a = encode_pair({"prompt": user, "chosen": [{"role": "assistant", "content": "3"}],
                     "rejected": [{"role": "assistant", "content": "4"}]}, tok, fmt, "x")
    b = encode_pair({"chosen": user + [{"role": "assistant", "content": "3"}],
                     "rejected": user + [{"role": "assistant", "content": "4"}]}, tok, fmt, "x")
    assert a == b
    (ids, mask), _ = a
    assert "3" in _resp(tok, ids, mask) and "1+2=" not in _resp(tok, ids, mask)
    assert "1+2=" in tok.decode(ids)
    # chat=true renders text records as the same user and assistant turns
    assert encode_pair({"prompt": "1+2=", "chosen": "3", "rejected": "4"}, tok, PreferenceFormat(chat=True), "x") == a


def test_bad_records_name_file_line_and_field(tmp_path, tok):
    f = tmp_path / "prefs.jsonl"
    f.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n\n"
                 + json.dumps({"prompt": "a", "rejected": "c"}) + "\n")
    with pytest.raises(DataError, match=r"prefs.jsonl, line 3: missing field 'chosen'"):
        encode_pairs(read_records(f), tok, PreferenceFormat(), seq_len=32, source=str(f))
    f.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "  "}) + "\n")
    with pytest.raises(DataError, match=r"prefs.jsonl, line 1: field 'rejected' has an empty response"):
        encode_pairs(read_records(f), tok, PreferenceFormat(), seq_len=32, source=str(f))
    f.write_text(json.dumps({"prompt": "a", "chosen": [], "rejected": "c"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: field 'chosen' must be a non-empty list"):
        encode_pairs(read_records(f), tok, PreferenceFormat(), seq_len=32, source=str(f))


def test_truncation_policies_and_counts(tok):
    recs = [{"prompt": "p" * 10, "chosen": "c" * 3, "rejected": "r" * 12}, {"prompt": "p" * 30, "chosen": "c",
                                                                         "rejected": "r"},
            {"prompt": "q", "chosen": "c", "rejected": "r"}]
    fmt = PreferenceFormat()
    start = encode_pairs(recs, tok, fmt, seq_len=20, truncation="keep_start")
    assert start.stats["num_pairs"] == 2 and start.stats["truncated_pairs"] == 1 and start.stats["dropped_pairs"] == 1
    row = start.arrays["input_ids"][0, 1]
    assert tok.decode(row[start.arrays["attention_mask"][0, 1] > 0]).endswith("r" * 8)  # response end cut
    end = encode_pairs(recs, tok, fmt, seq_len=20, truncation="keep_end")
    assert end.stats["num_pairs"] == 3 and end.stats["truncated_pairs"] == 2
    drop = encode_pairs(recs, tok, fmt, seq_len=20, truncation="drop")
    assert drop.stats["num_pairs"] == 1 and drop.stats["dropped_pairs"] == 2
    for pairs in (start, end, drop):  # padding: right, and no loss on it
        m, a = pairs.arrays["loss_mask"], pairs.arrays["attention_mask"]
        assert np.all(m <= a) and np.all(m[..., 0] == 0)


# ---------------------------------------------------------------------- micro-batching
@pytest.mark.slow
def test_dpo_grad_accum_equals_one_big_batch(tok):
    from posttrain.data.preference import stack_pairs
    from posttrain.models.config import llama_like
    from posttrain.models.transformer import init_model
    from posttrain.training.config import OptimConfig
    from posttrain.training.optim import make_optimizer
    from posttrain.training.trainer import Trainer

    cfg = llama_like(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2)
    recs = [json.loads(x) for x in (ROOT / "tests" / "data" / "dpo_tiny.jsonl").read_text().splitlines()[:8]]
    pairs = encode_pairs(recs, tok, PreferenceFormat(), seq_len=40)
    batch = stack_pairs([pairs[i] for i in range(8)], 8)
    loss = P.make_preference_loss(P.make_preset("sigmoid", beta=0.5), reference="reference")
    tx = make_optimizer(OptimConfig(name="sgd", lr=0.5, momentum=0.0, decay="constant", clip_norm=0.0), 4)[0]
    out = {}
    for k in (1, 4):
        tr = Trainer(init_model(cfg, seed=0), tx, grad_accum=k, donate=False, frozen={"reference": init_model(cfg, seed=0)})
        tr.step(batch, loss)  # the first step starts at the reference (loss log 2); the second has a real margin
        out[k] = (tr.step(batch, loss), tr.params)
    (m1, p1), (m4, p4) = out[1], out[4]
    assert m1["loss"] < 0.69 and m1["pairs"] == 8 == m4["pairs"]
    for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        np.testing.assert_allclose(m4[key], m1[key], rtol=2e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_precomputed_reference_equals_the_reference_in_the_step(tok, tmp_path):
    from posttrain.data.preference import stack_pairs
    from posttrain.models.config import llama_like
    from posttrain.models.transformer import init_model
    from posttrain.training.config import OptimConfig
    from posttrain.training.dpo import cached_reference, precompute_reference
    from posttrain.training.optim import make_optimizer
    from posttrain.training.trainer import Trainer

    cfg = llama_like(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2)
    recs = [json.loads(x) for x in (ROOT / "tests" / "data" / "dpo_tiny.jsonl").read_text().splitlines()[:6]]
    pairs = encode_pairs(recs, tok, PreferenceFormat(), seq_len=40)
    tx = make_optimizer(OptimConfig(name="sgd", lr=0.1, momentum=0.0, decay="constant"), 4)[0]
    tr = Trainer(init_model(cfg, seed=0), tx, donate=False, frozen={"reference": init_model(cfg, seed=3)})
    cache = tmp_path / "ref.npz"
    ref = precompute_reference(tr, "reference", pairs, 4, cache, "fp1")  # 6 pairs in batches of 4: a filler pair
    assert ref.shape == (6, 2)
    np.testing.assert_array_equal(cached_reference(cache, "fp1"), ref)
    assert cached_reference(cache, "other data or model") is None
    batch = stack_pairs([pairs[i] for i in range(6)], 6)
    spec = P.make_preset("ipo", beta=0.5)
    in_step = tr.eval_sums(batch, P.make_preference_loss(spec, reference="reference"))
    pre = tr.eval_sums(dict(batch, ref_logps=ref.reshape(-1)), P.make_preference_loss(spec, reference="precomputed"))
    assert pre[0] == pytest.approx(in_step[0], rel=1e-5) and pre[1] == in_step[1] == 6
    assert pre[2]["rewards/margins"][0] == pytest.approx(in_step[2]["rewards/margins"][0], rel=1e-4, abs=1e-5)


# ---------------------------------------------------------------------- parity with TRL 1.16
def _hf_grads(grads_state):
    """Our gradient State -> {HF tensor name: array} (the exporter's name and layout mapping)."""
    from flax import nnx

    from posttrain.models.hf_io import _hf_name, _to_hf

    out = {}
    for path, var in nnx.to_flat_state(grads_state):
        path, value = tuple(path), np.asarray(var.get_value() if hasattr(var, "get_value") else var)
        if path[0] == "layers":
            for i in range(value.shape[0]):
                name, n_in = _hf_name(path, i)
                out[name] = _to_hf(value[i], n_in)
        else:
            name, n_in = _hf_name(path, None)
            out[name] = _to_hf(value, n_in)
    return out


@pytest.fixture(scope="module")
def trl_setup(tmp_path_factory, tok):
    """A tiny llama as torch (policy and reference, different weights) and as ours, and 4 preference pairs."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    import transformers

    from posttrain.models.hf_io import from_pretrained
    from posttrain.models.tiny import resolve_model_path

    folder = Path(resolve_model_path("tiny:llama"))
    ref_dir = tmp_path_factory.mktemp("ref")
    torch.manual_seed(1)
    ref_t = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref_t.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref_t.save_pretrained(ref_dir)
    policy_t = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    records = [{"prompt": "12+7+30=", "chosen": "12+7=19,19+30=49 #### 49", "rejected": "#### 50"},
               {"prompt": "5+5+5=", "chosen": "5+5=10,10+5=15 #### 15", "rejected": "5+5=10,10+5=16 #### 16"},
               {"prompt": "81+2+9=", "chosen": "81+2=83,83+9=92 #### 92", "rejected": "#### 91"},
               {"prompt": "3+40+1=", "chosen": "3+40=43,43+1=44 #### 44", "rejected": "#### 54"}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ours = from_pretrained(folder, dtype="float32")
    ours_ref = from_pretrained(ref_dir, dtype="float32")
    return dict(torch=torch, policy_t=policy_t, ref_t=ref_t, hf_tok=hf_tok, ours=ours, ours_ref=ours_ref,
                records=records, folder=folder)


def _our_batch(s, tok):
    from posttrain.data.preference import stack_pairs

    pairs = encode_pairs(s["records"], tok, PreferenceFormat(), seq_len=40)
    return stack_pairs([pairs[i] for i in range(len(pairs))], len(pairs))


def _our_loss_and_grads(s, batch, spec, **kw):
    from flax import nnx

    gd, params, rest = nnx.split(s["ours"], nnx.Param, ...)
    loss_fn = P.make_preference_loss(spec, reference="reference" if spec.needs_reference else "none", **kw)
    frozen = {"reference": s["ours_ref"]}
    b = {k: jnp.asarray(v) for k, v in batch.items()}

    def f(p):
        ls, w, m = loss_fn(nnx.merge(gd, p, rest), b, frozen)
        return ls / w, m

    (loss, m), g = jax.value_and_grad(f, has_aux=True)(params)
    return float(loss), m, _hf_grads(g)


def _compare_grads(ours, torch_model, tol=1e-5):
    names = [n for n, _ in torch_model.named_parameters()]
    assert set(names) <= set(ours), set(names) - set(ours)
    for n, p in torch_model.named_parameters():
        t = p.grad.detach().numpy()
        scale = max(float(np.abs(t).max()), 1e-3)
        np.testing.assert_allclose(ours[n] / scale, t / scale, atol=tol, err_msg=n)


@pytest.mark.slow
@pytest.mark.full_optimization
def test_dpo_loss_logprobs_and_grads_equal_trl(trl_setup, tok, tmp_path):
    """DPOTrainer.compute_loss (sigmoid, β=0.5) on the same tiny model, reference and 4 pairs: TRL's own
    tokenisation equals ours, and loss, reward metrics and every parameter's gradient agree to 1e-5."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    s, torch = trl_setup, trl_setup["torch"]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.5, loss_type=["sigmoid"], report_to=[],
                     per_device_train_batch_size=4, max_length=None, use_cpu=True, logging_strategy="no",
                     save_strategy="no", dataset_num_proc=None, bf16=False)
    trainer = DPOTrainer(model=s["policy_t"], ref_model=s["ref_t"], args=args,
                         train_dataset=datasets.Dataset.from_list(s["records"]), processing_class=s["hf_tok"])
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    model = trainer.model
    model.train()
    model.zero_grad()
    loss_t = trainer.compute_loss(model, inputs)
    loss_t.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    batch = _our_batch(s, tok)
    # TRL's rows are [chosen x4, rejected x4]; ours interleave pairs (2i, 2i+1): same tokens and masks
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    t_ids, t_cm = inputs["input_ids"].numpy(), inputs["completion_mask"].numpy()
    width = t_ids.shape[1]
    np.testing.assert_array_equal(batch["input_ids"][order][:, :width] * batch["attention_mask"][order][:, :width],
                                  t_ids * inputs["attention_mask"].numpy())
    np.testing.assert_array_equal(batch["loss_mask"][order][:, :width], t_cm)
    # per-token log-probs of the policy vs transformers' on the same rows
    from posttrain.algorithms.sft import token_logprobs

    with torch.no_grad():
        logits = s["policy_t"](input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        lp_t = torch.log_softmax(logits[:, :-1], -1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0].numpy()
    lp_ours = np.asarray(token_logprobs(s["ours"], jnp.asarray(batch["input_ids"][order][:, :width]),
                                        attention_mask=jnp.asarray(batch["attention_mask"][order][:, :width])))
    sel = t_cm[:, 1:] > 0
    np.testing.assert_allclose(lp_ours[sel], lp_t[sel], atol=1e-5)

    loss, m, grads = _our_loss_and_grads(s, batch, P.make_preset("sigmoid", beta=0.5))
    assert loss == pytest.approx(float(loss_t.detach()), abs=1e-5)
    m = {k: float(v[0] / v[1]) if isinstance(v, tuple) else float(v) for k, v in m.items()}
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
              "logps/rejected"):
        assert m[k] == pytest.approx(trl_metrics[k], abs=1e-4), k
    _compare_grads(grads, model)


@pytest.mark.full_optimization
@pytest.mark.slow
def test_orpo_loss_and_grads_equal_trl(trl_setup, tok):
    """ORPO (λ = β = 0.25, NLL over prompt + response as TRL computes it) against TRL's ORPOTrainer code:
    its `get_batch_logps` (mean response log-probs), `odds_ratio_loss` and NLL, on the same model and batch."""
    from types import SimpleNamespace

    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    s, torch = trl_setup, trl_setup["torch"]
    batch = _our_batch(s, tok)
    model = s["policy_t"]
    model.zero_grad()
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    ids = torch.tensor(batch["input_ids"][order], dtype=torch.long)
    att = torch.tensor(batch["attention_mask"][order], dtype=torch.long)
    labels = torch.where(torch.tensor(batch["loss_mask"][order]) > 0, ids, torch.full_like(ids, -100))
    logits = model(input_ids=ids, attention_mask=att).logits
    nll = torch.nn.functional.cross_entropy(logits[:4, :-1].reshape(-1, logits.shape[-1]),
                                            torch.where(att[:4, 1:] > 0, ids[:4, 1:], -100).reshape(-1))
    logps = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    fake = SimpleNamespace(beta=0.25, accelerator=SimpleNamespace(device="cpu"))
    losses, *_ = ORPOTrainer.odds_ratio_loss(fake, logps[:4], logps[4:])
    loss_t = nll - losses.mean()
    loss_t.backward()

    batch = dict(batch, nll_weight=P.nll_weights(batch, nll_on_prompt=True))
    loss, m, grads = _our_loss_and_grads(s, batch, P.make_preset("orpo", beta=0.25), nll_on_prompt=True)
    assert loss == pytest.approx(float(loss_t.detach()), abs=1e-5)
    assert float(m["nll_loss"][0] / m["nll_loss"][1]) == pytest.approx(float(nll.detach()), abs=1e-5)
    _compare_grads(grads, model)
