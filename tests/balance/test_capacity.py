"""Capacity: the formula and exact dropped sets under both priorities."""

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from moejax.balance import capacity as cap
from tests.balance.helpers import make_result, uniform_probs

apply = jax.jit(cap.apply_capacity, static_argnames=("num_experts", "priority"))


@pytest.mark.parametrize("t, e, k, cf, want", [
    (8, 4, 2, 1.25, 5),     # ceil(1.25 * 16 / 4) = 5 exactly
    (10, 10, 1, 1.1, 2),    # ceil(1.1) = 2 (Switch, K=1)
    (10, 1, 1, 1.1, 11),    # 1.1 * 10 = 11.000000000000002 in floats: still 11
    (3, 8, 1, 1.0, 1),      # ceil(0.375) = 1
    (1, 64, 1, 1e-12, 1),   # never below 1
])
def test_expert_capacity(t, e, k, cf, want):
  assert cap.expert_capacity(t, e, k, cf) == want


def test_expert_capacity_rejects_bad_input():
  with pytest.raises(ValueError, match="capacity_factor=0"):
    cap.expert_capacity(8, 4, 2, 0)
  with pytest.raises(ValueError, match="num_experts=0"):
    cap.expert_capacity(8, 0, 2, 1.0)


# T=4, K=2, E=3, capacity 2.
IDS = [[0, 1], [0, 2], [0, 1], [1, 0]]
WEIGHTS = [[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.55, 0.45]]


def hand():
  return make_result(IDS, uniform_probs(4, 3), weights=WEIGHTS)


def dropped_set(dropped):
  return {tuple(int(x) for x in ij) for ij in np.argwhere(np.asarray(dropped))}


def test_position_priority_is_slot_major():
  # Expert 0 queue (all top-1 first): t0s0, t1s0, t2s0, t3s1 -> drop t2s0, t3s1.
  # Expert 1 queue: t3s0 (a top-1) before t0s1, t2s1 -> drop t2s1. Expert 2 keeps t1s1.
  # (Token-major order would have dropped t3's top-1 choice instead.)
  new, dropped = apply(hand(), 2, num_experts=3, priority="position")
  assert dropped_set(dropped) == {(2, 0), (3, 1), (2, 1)}
  assert not np.any(np.asarray(new.valid) & np.asarray(dropped))
  np.testing.assert_array_equal(np.asarray(new.weights)[np.asarray(dropped)], 0.0)
  np.testing.assert_array_equal(np.asarray(new.expert_ids)[np.asarray(dropped)], 0)
  np.testing.assert_array_equal(np.asarray(new.weights)[~np.asarray(dropped)],
                                np.asarray(WEIGHTS, np.float32)[~np.asarray(dropped)])


def test_score_priority_keeps_highest_gates():
  # Expert 0 copies: t0 .6, t1 .7, t2 .9, t3(s1) .45 -> keep t2, t1.
  # Expert 1 copies: t3 .55, t0(s1) .4, t2(s1) .1 -> keep t3, t0.
  _, dropped = apply(hand(), 2, num_experts=3, priority="score")
  assert dropped_set(dropped) == {(0, 0), (3, 1), (2, 1)}


def test_score_ties_fall_back_to_position():
  r = make_result([[0], [0], [0]], uniform_probs(3, 2), weights=[[0.5], [0.5], [0.5]])
  _, dropped = apply(r, 1, num_experts=2, priority="score")
  assert dropped_set(dropped) == {(1, 0), (2, 0)}


def test_zero_compute_and_invalid_slots_never_dropped_nor_counted():
  # Expert 2 is a zero-computation expert (num_experts=2): unlimited.
  valid = [[False, True], [True, True], [True, True]]
  r = make_result([[0, 2], [0, 2], [0, 2]], uniform_probs(3, 3), valid=valid)
  _, dropped = apply(r, 1, num_experts=2, priority="position")
  # t0's slot 0 is invalid, so t1 gets the one place on expert 0 and t2 is dropped.
  assert dropped_set(dropped) == {(2, 0)}


def test_capacity_zero_drops_every_ffn_copy_and_bad_priority_fails():
  _, dropped = apply(hand(), 0, num_experts=3, priority="position")
  assert np.all(np.asarray(dropped))
  with pytest.raises(ValueError, match="priority='gate'"):
    cap.apply_capacity(hand(), 2, num_experts=3, priority="gate")


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(seed=st.integers(0, 10_000), c=st.integers(0, 6),
                  priority=st.sampled_from(["position", "score"]))
def test_capacity_properties(seed, c, priority):
  t, k, e, e_r = 8, 2, 4, 5  # id 4 is a zero-computation expert
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.choice(e_r, size=k, replace=False) for _ in range(t)])
  valid = rng.random((t, k)) < 0.9
  weights = rng.random((t, k)).astype(np.float32)
  r = make_result(ids, uniform_probs(t, e_r), valid=valid, weights=weights)
  new, dropped = apply(r, c, num_experts=e, priority=priority)
  dropped, kept = np.asarray(dropped), np.asarray(new.valid)
  assert not np.any(dropped & ~valid)
  assert not np.any(dropped & (ids >= e))
  np.testing.assert_array_equal(kept | dropped, valid)
  for x in range(e):
    on_x = valid & (ids == x)
    assert (kept & (ids == x)).sum() == min(on_x.sum(), c)  # drop only beyond capacity
    if dropped[ids == x].any() and (kept & (ids == x)).any():
      if priority == "score":
        assert weights[kept & (ids == x)].min() >= weights[dropped & (ids == x)].max()
      else:
        slot_major = np.arange(t * k).reshape(k, t).T
        assert slot_major[kept & (ids == x)].max() < slot_major[dropped & (ids == x)].min()
  _, none = apply(r, t * k, num_experts=e, priority=priority)
  assert not np.asarray(none).any()
