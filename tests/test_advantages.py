"""Hand-computed checks of the group advantage estimators and DAPO's host-side helpers."""

import math

import numpy as np
import pytest

from posttrain.algorithms.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from posttrain.algorithms.dapo import expand_group_mask, groups_with_signal, overlong_mask

# Two prompts, G = 3 completions each, group-contiguous.
REWARDS = [3.0, 0.0, 0.0, 1.0, 2.0, 3.0]


def test_grpo_advantages_population_std():
    adv = np.asarray(grpo_advantages(REWARDS, group_size=3, eps=0.0))
    assert adv.dtype == np.float32 and adv.shape == (6,)
    # group 1: mean 1, deviations [2, -1, -1], population var (4+1+1)/3 = 2, std sqrt(2)
    #   -> [2/sqrt2, -1/sqrt2, -1/sqrt2] = [1.41421, -0.70711, -0.70711]
    #   (a sample std sqrt(3) would give [1.1547, -0.5774, -0.5774])
    # group 2: mean 2, deviations [-1, 0, 1], var 2/3, std 0.81650 -> [-1.22474, 0, 1.22474]
    s2, s23 = math.sqrt(2.0), math.sqrt(2.0 / 3.0)
    np.testing.assert_allclose(adv, [2 / s2, -1 / s2, -1 / s2, -1 / s23, 0.0, 1 / s23], rtol=1e-6)


def test_grpo_eps_and_constant_group():
    # constant group: std 0 -> (r - mean) / (0 + eps) = 0 exactly, no NaN
    adv = np.asarray(grpo_advantages([5.0, 5.0, 1.0, 0.0], group_size=2, eps=1e-6))
    # group 2: mean 0.5, std 0.5 -> +-0.5 / (0.5 + 1e-6) = +-0.999998
    np.testing.assert_allclose(adv, [0.0, 0.0, 0.5 / 0.500001, -0.5 / 0.500001], rtol=1e-6)


def test_dr_grpo_advantages():
    adv = np.asarray(dr_grpo_advantages(REWARDS, group_size=3))
    # r - group mean: [3-1, 0-1, 0-1, 1-2, 2-2, 3-2]
    np.testing.assert_allclose(adv, [2.0, -1.0, -1.0, -1.0, 0.0, 1.0])
    assert adv.dtype == np.float32


def test_rloo_advantages():
    adv = np.asarray(rloo_advantages(REWARDS, group_size=3))
    # r_i - mean of the other two:
    # group 1: 3-(0+0)/2 = 3, 0-(3+0)/2 = -1.5, -1.5
    # group 2: 1-(2+3)/2 = -1.5, 2-(1+3)/2 = 0, 3-(1+2)/2 = 1.5
    np.testing.assert_allclose(adv, [3.0, -1.5, -1.5, -1.5, 0.0, 1.5])


def test_advantage_input_validation():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages([1.0, 2.0, 3.0], group_size=2)
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages([1.0, 2.0], group_size=1)


def test_groups_with_signal():
    rewards = [1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.25]
    np.testing.assert_array_equal(groups_with_signal(rewards, 3), [False, True, False, True])
    np.testing.assert_array_equal(expand_group_mask([False, True], 2), [False, False, True, True])
    with pytest.raises(ValueError):
        groups_with_signal([1, 2, 3], 2)


def test_overlong_mask():
    m = overlong_mask(["stop", "length", "eos", "length"])
    assert m.dtype == np.float32
    np.testing.assert_array_equal(m, [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(overlong_mask(np.array([False, True, False])), [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(overlong_mask([True, False]), [0.0, 1.0])
