"""Tokens recorded once (issue 42): a trajectory's `TokenBuffer` is read from the sampler's record of the sequence
(`TokenBuffer.from_completion`) and equals the buffer recorded turn by turn; the sampler keeps no module-level
mutable state and no per-call data (images) on itself."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from posttrain.agent import TokenBuffer
from posttrain.sampling import Completion

SAMPLING = Path(__file__).parents[1] / "posttrain" / "sampling"


def _runs(rng, n_turns: int):
    """A conversation as the sampler records it: sampled runs (with log-probs) and appended runs in between."""
    runs = []
    for k in range(n_turns):
        n = int(rng.integers(1, 6))
        runs.append((1, rng.integers(3, 50, size=n).tolist(), (-rng.uniform(0.1, 3.0, size=n)).tolist()))
        if k < n_turns - 1:
            m = int(rng.integers(1, 4))
            runs.append((0, rng.integers(3, 50, size=m).tolist(), [0.0] * m))
    return runs


@pytest.mark.parametrize("seed", range(5))
def test_from_completion_equals_the_buffer_recorded_turn_by_turn(seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 50, size=4).tolist()
    runs = _runs(rng, int(rng.integers(1, 5)))
    want = TokenBuffer()
    want.add_prompt(prompt)
    for sampled, ids, lps in runs:
        want.add_sampled(ids, lps) if sampled else want.add_appended(ids)
    c = Completion(0, 0, [i for _, ids, _ in runs for i in ids], [p for _, _, lps in runs for p in lps], None,
                   "stop", mask=[m for m, ids, _ in runs for _ in ids], turns=sum(m for m, _, _ in runs))
    got = TokenBuffer.from_completion(prompt, c)
    assert (got.ids, got.loss_mask, got.turns, got.turn) == (want.ids, want.loss_mask, want.turns, want.turn)
    a, b = got.arrays(), want.arrays()
    np.testing.assert_array_equal(a["logprobs"], b["logprobs"])  # NaN at the prompt and appended ids, both
    assert all(math.isnan(p) for p, m in zip(got.logprobs, got.loss_mask) if not m)


def test_a_single_turn_completion_is_all_sampled_and_bad_lengths_are_refused():
    c = Completion(0, 0, [5, 6, 7], [-0.1, -0.2, -0.3], None, "stop")  # mask None: a plain single-turn call
    buf = TokenBuffer.from_completion([1, 2], c)
    assert buf.loss_mask == [0, 0, 1, 1, 1] and buf.sampled_ids == [5, 6, 7] and buf.turns == [0] * 5
    with pytest.raises(ValueError, match="3 ids with 2 log-probs"):
        TokenBuffer.from_completion([1], Completion(0, 0, [5, 6, 7], [-0.1, -0.2], None, "stop"))


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in {
        "list", "dict", "set", "Counter", "defaultdict", "OrderedDict", "deque", "WeakKeyDictionary"}


def test_the_sampling_package_has_no_module_level_mutable_state():
    found = []
    for path in sorted(SAMPLING.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) and node.value is not None else []
            value = getattr(node, "value", None)
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names and names != ["__all__"] and value is not None and _mutable(value):
                found.append(f"{path.name}:{node.lineno} {names[0]}")
    assert not found, found


@pytest.mark.slow
def test_a_call_keeps_its_images_in_its_own_request():
    """No sampler attribute refers to a call's images while it runs (they live in the call's `Request`)."""
    from posttrain.models.tiny_vlm import BOI, EOI, IMAGE, VLM_SPECIAL_TOKENS, tiny_vlm_config
    from posttrain.models.transformer import init_model
    from posttrain.sampling import Sampler, SamplingParams

    cfg = tiny_vlm_config(64, image_size=16, mm_tokens_per_image=4)
    img, boi, eoi = (VLM_SPECIAL_TOKENS.index(t) for t in (IMAGE, BOI, EOI))
    sampler = Sampler(init_model(cfg, seed=0), max_slots=2)
    pixels = np.random.default_rng(0).uniform(-1, 1, size=(3, 16, 16)).astype(np.float32)
    seen = []

    def progress(done, total, tokens, seconds):
        seen.append([k for k, v in vars(sampler).items() if _holds(v, pixels)])

    out = sampler.generate([[2, boi] + [img] * 4 + [eoi, 20]], SamplingParams(max_new_tokens=3, temperature=0.0),
                           images=[[pixels]], progress=progress)
    assert len(out) == 1 and seen and not any(seen)
    assert not any(_holds(v, pixels) for v in vars(sampler).values())


def _holds(value, pixels, depth: int = 3) -> bool:
    if isinstance(value, np.ndarray):
        return value.shape == pixels.shape and np.array_equal(value, pixels)
    if depth and isinstance(value, (list, tuple)):
        return any(_holds(v, pixels, depth - 1) for v in value)
    return False
