"""Routing replay in RL (`learner.routing_replay`): the sampler's recorded experts travel with the rollouts (also as
JSON), land in the batch aligned with the tokens (-1 on padding and last tokens), survive packing (shared prompts
too), and the learner's recomputed log-probs and update route to them, the reference not; a dense model refuses the
key; runs through the CLI and the fleet log `moe/router_agreement` and `mismatch_kl`; with replay off nothing
changes."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from posttrain.models import init_model
from posttrain.models.tiny import tiny_config
from posttrain.rl.batch import build_rl_batch
from posttrain.rl.loss import packed_logprobs, padded_logprobs
from posttrain.rl.packing import pack_rl_batch, pack_shared_prompts
from posttrain.rollout.rollouts import Rollouts

REPO = Path(__file__).resolve().parents[1]
CFG = tiny_config("tiny:qwen3_moe", 64)  # 2 sparse layers, 4 experts, top-2
PROMPTS = (7, 7, 7, 4, 4, 4)  # two groups of three, each sharing its prompt
COMPLETIONS = (6, 2, 11, 4, 1, 9)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _own_experts(model, ids: list[int]) -> np.ndarray:
    """The model's own routing of one sequence, [len(ids), L_sparse, k] (what a sampler feeding it records)."""
    return np.asarray(model(np.asarray([ids]), routing=True)[1].experts)[0]


def _forced(own: np.ndarray, ids: list[int]) -> np.ndarray:
    """`own` with the first sparse layer sent to the experts the router did not choose at every token whose id is
    even (a function of the token, so equal prompts get equal records: what shared-prompt rows assume)."""
    out = own.copy()
    for t, tok in enumerate(ids[: len(own)]):
        if tok % 2 == 0:
            out[t, 0] = sorted(set(range(CFG.num_experts)) - set(own[t, 0].tolist()))
    return out


def _rollouts(model=None, seed=0) -> Rollouts:
    """Two groups of three samples; recorded experts [len(prompt) + len(completion) - 1, L_sparse, k] per sample:
    with a model, its own routing partly forced onto other experts (`_forced`), else each row's token id % 100
    (so alignment is checked by hand)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in PROMPTS[::3]]
    prompt_ids = [prompts[i // 3] for i in range(6)]
    completions = [rng.integers(3, CFG.vocab_size, size=n).tolist() for n in COMPLETIONS]
    experts = []
    for p, c in zip(prompt_ids, completions):
        fed = (p + c)[:-1]
        if model is None:
            experts.append(np.broadcast_to(np.asarray(fed, np.int8)[:, None, None] % 100, (len(fed), 2, 2)).copy())
        else:
            experts.append(_forced(_own_experts(model, fed), fed))
    return Rollouts(group_size=3, record_index=[0, 0, 0, 1, 1, 1], prompt_ids=prompt_ids,
                    completion_ids=completions, logprobs=[(-rng.uniform(0.5, 4.0, size=n)).tolist() for n in COMPLETIONS],
                    finish_reasons=["stop"] * 6, texts=[""] * 6, prompts_text=[""] * 6,
                    rewards=np.arange(6, dtype=np.float32), per_reward={}, reward_stats={}, uid=[0, 0, 0, 1, 1, 1],
                    routed_experts=experts)


def _check_aligned(ids, attention_mask, experts):
    """By hand: every recorded entry holds its column's token id (`_rollouts` without a model); -1 on padding and on
    each sequence's last token (segments of packed rows included)."""
    for r in range(len(ids)):
        real = np.flatnonzero(attention_mask[r])
        for col in range(ids.shape[1]):
            e = experts[r, col]
            if col in real and col + 1 in real:  # a fed token (not the last of its run)
                assert (e == ids[r, col] % 100).all(), (r, col)
            elif col not in real:
                assert (e == -1).all(), (r, col)


def test_batch_aligns_recorded_experts_with_the_tokens():
    ro = _rollouts()
    b = build_rl_batch(ro, np.zeros(6, np.float32), multiple=8)
    assert b.routed_experts.shape == (*b.input_ids.shape, 2, 2) and b.routed_experts.dtype == np.int8
    _check_aligned(b.input_ids, b.attention_mask, b.routed_experts)
    p = b.input_ids.shape[1] - b.completion_len
    for i, c in enumerate(ro.completion_ids):
        assert (b.routed_experts[i, p + len(c) - 1] == -1).all()  # the last token: never fed, nothing recorded
        assert (b.routed_experts[i, p + len(c) - 2] == (ro.prompt_ids[i] + c)[-2] % 100).all()
    assert "replay" not in b.model_inputs() and b.model_inputs(replay=True)["replay"] is b.routed_experts
    plain = build_rl_batch(Rollouts(**{**ro.__dict__, "routed_experts": []}), np.zeros(6, np.float32), multiple=8)
    assert plain.routed_experts is None and "replay" not in plain.model_inputs(replay=True)


@pytest.mark.parametrize("layout", ["sequences", "shared prompts"])
def test_packing_carries_the_recorded_experts_with_their_tokens(layout):
    b = build_rl_batch(_rollouts(), np.zeros(6, np.float32), multiple=8)
    packed, _ = pack_rl_batch(b) if layout == "sequences" else pack_shared_prompts(b, 3)
    ids, experts = np.asarray(packed.input_ids), np.asarray(packed.routed_experts)
    assert experts.shape == (*ids.shape, 2, 2)
    for r in range(len(ids)):  # per segment: its tokens' records, -1 on the last token of a completion and padding
        seg = np.asarray(packed.segment_ids)[r]
        for s in set(seg.tolist()) - {0}:
            cols = np.flatnonzero(seg == s)
            assert all((experts[r, c] == ids[r, c] % 100).all() for c in cols[:-1]), (r, s)
            assert (experts[r, cols[-1]] == (ids[r, cols[-1]] % 100 if s < 0 else -1)).all()
        assert (experts[r, seg == 0] == -1).all()


def test_rollouts_carry_recorded_experts_through_groups_and_json():
    ro = _rollouts()
    back = Rollouts.from_json(json.loads(json.dumps(ro.to_json())))
    again = Rollouts.concat(back.groups())
    for a, b in zip(ro.routed_experts, again.routed_experts):
        assert b.dtype == a.dtype and np.array_equal(a, b)
    assert Rollouts.from_json(json.loads(json.dumps(_plain(ro).to_json()))).routed_experts == []


def _plain(ro: Rollouts) -> Rollouts:
    return Rollouts(**{**ro.__dict__, "routed_experts": []})


@pytest.mark.full_optimization
@pytest.mark.parametrize("layout", ["sequences", "shared prompts"])
@pytest.mark.slow
def test_packed_log_probs_equal_padded_under_replay(model, layout):
    """Packed and padded forwards route to the same recorded experts: equal log-probs (1e-5), and not those of the
    model's own routing (the forced records matter)."""
    b = build_rl_batch(_rollouts(model), np.zeros(6, np.float32), multiple=8)
    packed, lay = pack_rl_batch(b) if layout == "sequences" else pack_shared_prompts(b, 3)
    padded = jax.jit(lambda bb: padded_logprobs(model, bb, replay=bb.routed_experts)[0])(b)
    own = jax.jit(lambda bb: padded_logprobs(model, bb)[0])(b)
    got = lay.unpack(jax.jit(lambda pb: packed_logprobs(model, pb, replay=pb.routed_experts)[0])(packed))
    m = b.loss_mask > 0
    np.testing.assert_allclose(got[m], np.asarray(padded)[m], atol=1e-5)
    assert np.abs(np.asarray(padded) - np.asarray(own))[m].max() > 1e-3


def _learner(model_seed=0, *, pack=False, attn_span=None):
    from posttrain.rl.learner import FrozenScorer, Learner
    from posttrain.rl.loss import make_rl_loss
    from posttrain.training.config import OptimConfig
    from posttrain.training.optim import make_optimizer
    from posttrain.training.trainer import Trainer

    tx = make_optimizer(OptimConfig(name="sgd", lr=0.1, momentum=0.0, decay="constant", clip_norm=0.0), 10)[0]
    trainer = Trainer(init_model(CFG, seed=model_seed), tx, donate=False)
    return Learner(trainer, make_rl_loss({"beta": 0.05, "kl_estimator": "k3"}), ppo_epochs=1, minibatches=1,
                   seed=0, recompute_old=True,
                   ref_fn=FrozenScorer(init_model(CFG, seed=model_seed), trainer), pack=pack, attn_span=attn_span)


@pytest.mark.full_optimization
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.slow
def test_learner_recomputes_old_log_probs_with_replay_and_the_reference_without(model, pack):
    """Old (proximal) log-probs: the policy routed to the records (padded and packed scoring alike); the reference
    (the same initial weights here) with its own router; the update reports the agreement."""
    b = build_rl_batch(_rollouts(model), np.linspace(-1, 1, 6).astype(np.float32), multiple=8)
    learner = _learner(pack=pack, attn_span=1e9 if pack else None)
    scored = learner.score(b)
    m = b.loss_mask > 0
    replayed = np.asarray(jax.jit(lambda bb: padded_logprobs(model, bb, replay=bb.routed_experts)[0])(b))
    own = np.asarray(jax.jit(lambda bb: padded_logprobs(model, bb)[0])(b))
    np.testing.assert_allclose(scored.old_logp[m], replayed[m], atol=1e-5)
    np.testing.assert_allclose(scored.ref_logp[m], own[m], atol=1e-5)
    metrics = learner.update(b, 1)
    assert 0.0 < metrics["moe/router_agreement"] < 1.0  # the forced records disagree with the router, in part
    assert metrics["kl"] > 0 and np.isfinite(metrics["mismatch_kl"])


@pytest.mark.slow
def test_learner_without_records_scores_as_before(model):
    """A batch without records (replay off): the policy's recomputed log-probs are the trainer's own, exactly."""
    b = build_rl_batch(_plain(_rollouts(model)), np.zeros(6, np.float32), multiple=8)
    learner = _learner()
    scored = learner.score(b)
    want = learner.trainer.token_logprobs(b.model_inputs(), last=b.completion_len)
    assert np.array_equal(scored.old_logp, np.asarray(want))


def test_replay_on_a_dense_model_is_a_one_line_config_error(tmp_path):
    from posttrain.config import ConfigError
    from posttrain.rl.loop import load_rl_config
    from posttrain.rl.setup import build_rl

    cfg = load_rl_config(REPO / "configs" / "rl_moe_smoke.yaml", [
        f"output_dir={tmp_path / 'rl'}", "model.path=tiny:llama", f"data.train={REPO / 'tests/data/rl_prompts_tiny.jsonl'}",
        "learner.routing_replay=true"])
    with pytest.raises(ConfigError, match="learner.routing_replay") as e:
        build_rl(cfg)
    assert "\n" not in str(e.value)


class _RecordingSampler:
    """A stand-in sampler whose completions carry experts of a given length error (`off`)."""

    cfg = CFG
    version = 3

    def __init__(self, off=0):
        self.off, self.calls = off, []

    def generate(self, prompt_ids, params, **kw):
        from posttrain.sampling.params import Completion

        self.calls.append(kw)
        out = []
        for p, ids in enumerate(prompt_ids):
            c = Completion(prompt_index=p, sample_index=0, token_ids=[5, 6, 7], logprobs=[-1.0] * 3,
                           sampling_logprobs=None, finish_reason="stop", text="abc")
            if kw.get("record_experts"):
                c.routed_experts = np.zeros((len(ids) + 3 - 1 + self.off, 2, 2), np.int8)
            out.append(c)
        return out


def test_generate_rollouts_asks_for_and_checks_the_records():
    from posttrain.rewards.runner import RewardRunner, RewardSpec
    from posttrain.rollout.collect import generate_rollouts
    from posttrain.rollout.policy import Policy
    from posttrain.rollout.prompts import PromptSet
    from posttrain.sampling import SamplingParams

    prompts = PromptSet.of([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}], [[1, 2], [3, 4, 5]])
    with RewardRunner([RewardSpec("math_answer")], num_workers=0) as runner:
        sampler = _RecordingSampler()
        plain = generate_rollouts(Policy(None, None, sampler=sampler), prompts, SamplingParams(n=1), runner)
        assert plain.routed_experts == [] and "record_experts" not in sampler.calls[-1]
        ro = generate_rollouts(Policy(None, None, sampler=sampler), prompts, SamplingParams(n=1), runner,
                               record_experts=True)
        assert [e.shape for e in ro.routed_experts] == [(4, 2, 2), (5, 2, 2)]
        with pytest.raises(RuntimeError, match="routing replay"):
            generate_rollouts(Policy(None, None, sampler=_RecordingSampler(off=1)), prompts, SamplingParams(n=1),
                              runner, record_experts=True)


# ---------------------------------------------------------------------- runs: the CLI, replay off, the fleet
SMOKE = REPO / "configs" / "rl_moe_smoke.yaml"
RUN = ("trainer.max_steps=2", "trainer.save_every=0", "trainer.progress=false")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _cli(config: Path, out: Path, *overrides: str) -> list[dict]:
    from posttrain.cli.main import main

    assert main(["--no-compile-cache", "rl", str(config), f"output_dir={out}", *RUN, *overrides]) == 0
    return [r for r in _rows(out) if "loss" in r]


@pytest.fixture
def in_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "tiny"))
    return tmp_path


@pytest.mark.slow  # ~40 s on 2 shared cores
def test_rl_with_replay_through_the_cli_logs_agreement_and_mismatch(in_repo):
    steps = _cli(SMOKE, in_repo / "rl", "learner.routing_replay=true")
    assert len(steps) == 2
    for r in steps:
        assert 0.0 < r["moe/router_agreement"] <= 1.0
        assert np.isfinite(r["mismatch_kl"]) and r["mismatch_kl"] >= 0.0


@pytest.mark.slow  # two runs of ~35 s
def test_replay_off_changes_nothing(in_repo):
    """The key at false gives the metrics of a config without it (timings aside), and no agreement metric."""
    text = SMOKE.read_text()
    without = in_repo / "no_key.yaml"
    without.write_text("\n".join(x for x in text.splitlines() if "routing_replay" not in x) + "\n")
    assert "routing_replay" not in without.read_text() and "routing_replay: false" in text
    a = _cli(without, in_repo / "a")
    b = _cli(SMOKE, in_repo / "b", "learner.routing_replay=false")
    untimed = [[{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/")) and not k.endswith("_s")}
                for r in rows] for rows in (a, b)]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 2
    assert "moe/router_agreement" not in a[0] and "mismatch_kl" in a[0]


@pytest.mark.slow  # a Ray fleet of one worker and the same run in-process
def test_fleet_with_replay_reproduces_the_in_process_run(in_repo):
    """The worker records the experts and returns them with the groups: one worker at staleness 0 reproduces the
    in-process replay run step for step (agreement and mismatch_kl included)."""
    from posttrain.rl.loop import load_rl_config, run_rl

    runs = {}
    for name, extra in (("sync", []), ("fleet", ["fleet.workers=1", "fleet.max_staleness=0"])):
        cfg = load_rl_config(SMOKE, [f"output_dir={in_repo / name}", *RUN, "learner.routing_replay=true", *extra])
        runs[name] = run_rl(cfg).history
    sync, fleet = runs["sync"], runs["fleet"]
    assert len(sync) == len(fleet) == 2
    for a, b in zip(sync, fleet):
        same = [k for k in a if not k.startswith(("time/", "fleet/", "throughput/")) and k in b]
        assert {"reward/mean", "loss", "mismatch_kl", "moe/router_agreement"} <= set(same)
        for key in same:
            np.testing.assert_allclose(b[key], a[key], atol=1e-5, err_msg=key)
        assert b["fleet/staleness_max"] == 0


@pytest.mark.slow  # one multi-turn RL step on the tiny MoE
def test_multi_turn_records_cover_sampled_and_appended_tokens(in_repo, monkeypatch):
    """Multi-turn (the guess-the-number environment): the batch's records cover every fed token, sampled and
    appended (tool observations), and equal the routing of the trainer's own forward of the batch before the update
    (the sampler's weights), column for column."""
    from posttrain.rl.learner import Learner
    from posttrain.rl.loop import load_rl_config, run_rl

    (in_repo / "guess.jsonl").write_text("".join(
        json.dumps({"prompt": "guess", "secret": 10 + i, "max_guesses": 4}) + "\n" for i in range(4)))
    seen = []
    update = Learner.update

    def spy(self, batch, step):
        model = self.trainer.model()
        own = model(batch.input_ids, attention_mask=batch.attention_mask, positions=batch.positions, routing=True)[1]
        seen.append((batch, np.asarray(own.experts)))
        return update(self, batch, step)

    monkeypatch.setattr(Learner, "update", spy)
    run_rl(load_rl_config(None, [
        f"output_dir={in_repo / 'mt'}", "model.path=tiny:qwen3_moe", f"data.train={in_repo / 'guess.jsonl'}",
        "rollout.batch_prompts=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        f"rollout.stop_token_ids=[{', '.join(str(i) for i in range(2, 60))}]",
        "rollout.environment=posttrain.agent.envs.guess_number:GuessNumber", "rollout.max_turns=4",
        "rollout.max_total_tokens=160", "rewards.functions=[]", "rewards.correctness=environment",
        "rewards.num_workers=0", "learner.routing_replay=true", "learner.old_logprobs=recompute", *RUN,
        "trainer.max_steps=1", "eval.at_start=false"]))
    (batch, own), = seen
    rec = np.asarray(batch.routed_experts)
    recorded = (rec >= 0).all(axis=(-2, -1))
    real = np.asarray(batch.attention_mask) > 0
    last = real & ~np.roll(real, -1, axis=1)  # each row's last real column
    assert np.array_equal(recorded, real & ~last)  # every fed token, nothing else
    c = batch.completion_len
    appended = (np.asarray(batch.loss_mask) == 0) & real[:, -c:] & recorded[:, -c:]
    assert appended.sum() > 0  # observations were appended, and are covered
    same = np.all(np.sort(rec, -1) == np.sort(own, -1), axis=(-2, -1))
    assert same[recorded].mean() >= 0.99, same[recorded].mean()  # float32: the sampler routed as the trainer does
