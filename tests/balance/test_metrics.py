"""Load metrics: hand-computed values and properties."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from moejax import config as C
from moejax.balance import capacity as cap
from moejax.balance import metrics as M
from tests.balance.helpers import make_result, uniform_probs
from tests.configs import moe_config

# E_r = 4 router outputs: FFN experts 0,1 and zero-computation experts 2,3.
ZC_IDS = [[0, 1], [0, 2], [2, 3], [1, 0]]
ZC_VALID = [[True, True], [True, True], [True, True], [True, False]]


def zc():
  return make_result(ZC_IDS, uniform_probs(4, 4), valid=ZC_VALID)


def test_expert_load_counts_valid_ffn_copies():
  np.testing.assert_array_equal(M.expert_load(zc(), 2), [2.0, 2.0])
  np.testing.assert_array_equal(M.expert_load(zc(), 4), [2.0, 2.0, 2.0, 1.0])  # all outputs


def test_max_vio_hand():
  np.testing.assert_allclose(M.max_vio(jnp.array([1.0, 2.0, 3.0, 6.0])), 1.0)  # (6-3)/3
  np.testing.assert_allclose(M.max_vio(jnp.array([8.0, 0.0, 0.0, 0.0])), 3.0)  # E - 1
  assert float(M.max_vio(jnp.zeros(4))) == 0.0


def test_max_vio_accumulator_global_differs_from_batch():
  acc = M.MaxVioAccumulator.zeros(2)
  step = jax.jit(lambda a, l: a.add(l))
  for load in ([4.0, 0.0], [0.0, 4.0]):  # each batch MaxVio_batch = 1
    assert float(M.max_vio(jnp.array(load))) == 1.0
    acc = step(acc, jnp.array(load))
  np.testing.assert_array_equal(acc.load, [4.0, 4.0])
  assert float(acc.value()) == 0.0  # MaxVio_global = 0 over the two batches


def test_drop_rate_hand():
  valid = jnp.array([[True, True], [True, True], [True, True], [True, False]])
  dropped = jnp.array([[False, True], [False, False], [True, True], [False, False]])
  np.testing.assert_allclose(M.drop_rate(dropped, valid), 3 / 7)
  assert float(M.drop_rate(dropped, jnp.zeros_like(valid))) == 0.0


def test_load_entropy_hand():
  np.testing.assert_allclose(M.load_entropy(jnp.array([1.0, 1.0, 1.0, 1.0])), 1.0, rtol=1e-6)
  np.testing.assert_allclose(M.load_entropy(jnp.array([4.0, 0.0, 0.0, 0.0])), 0.0, atol=1e-7)
  np.testing.assert_allclose(M.load_entropy(jnp.array([2.0, 2.0, 0.0, 0.0])),
                             math.log(2) / math.log(4), rtol=1e-6)  # = 0.5
  assert float(M.load_entropy(jnp.array([3.0]))) == 1.0
  assert float(M.load_entropy(jnp.zeros(3))) == 0.0


def test_active_experts_excludes_zero_compute():
  count, mean, var = M.active_experts(zc(), 2)
  np.testing.assert_array_equal(count, [2, 1, 0, 1])
  np.testing.assert_allclose(mean, 1.0)
  np.testing.assert_allclose(var, 0.5)  # ((2-1)^2 + 0 + (0-1)^2 + 0) / 4
  # Fixed top-2 over FFN experts only: every token spends exactly 2, variance 0.
  _, mean, var = M.active_experts(make_result([[0, 1], [1, 0], [0, 1]], uniform_probs(3, 2)), 2)
  np.testing.assert_allclose([mean, var], [2.0, 0.0])


def test_coactivation_hand():
  r = make_result([[0, 1], [0, 2], [1, 2], [0, 1]], uniform_probs(4, 3))
  np.testing.assert_array_equal(M.coactivation(r, 3), [[3, 2, 1], [2, 3, 1], [1, 1, 2]])
  # FFN-only view of zc(): token 0 uses {0, 1}, token 3 uses {1} (its slot 1 is invalid).
  np.testing.assert_array_equal(M.coactivation(zc(), 2), [[2, 1], [1, 2]])


def test_routing_metrics_bundle():
  cfg = moe_config(num_experts=2, zero_experts=1, copy_experts=1,
                    routing=C.RoutingConfig(top_k=2))
  out = M.routing_metrics(zc(), cfg)
  np.testing.assert_array_equal(out.load, [2.0, 2.0])
  assert float(out.max_vio) == 0.0 and float(out.load_entropy) == 1.0
  np.testing.assert_allclose([out.active_mean, out.active_var], [1.0, 0.5])
  np.testing.assert_allclose(out.zero_compute_fraction, 3 / 7)
  np.testing.assert_array_equal(out.coactivation, [[2, 1], [1, 2]])
  assert out.drop_rate is None
  # Capacity 1, slot-major: expert 0 keeps t0s0 and drops t1s0; expert 1 keeps t3s0
  # (a top-1 choice) and drops t0s1.
  _, dropped = cap.apply_capacity(zc(), 1, num_experts=2)
  np.testing.assert_array_equal(np.argwhere(np.asarray(dropped)), [[0, 1], [1, 0]])
  # Metrics take the decision before capacity: the load is what the router
  # asked for; the active budget is what was computed (FFN copies kept per
  # token: 1, 0, 0, 1); the drop rate how much capacity removed.
  out = M.routing_metrics(zc(), cfg, dropped=dropped)
  np.testing.assert_array_equal(out.load, [2.0, 2.0])
  np.testing.assert_allclose([out.active_mean, out.active_var], [0.5, 0.25])
  np.testing.assert_allclose(out.drop_rate, 2 / 4)  # 2 of the 4 FFN copies


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(load=st.lists(st.integers(0, 20), min_size=4, max_size=4))
def test_max_vio_zero_iff_uniform(load):
  v = float(M.max_vio(jnp.array(load, jnp.float32)))
  assert v >= 0.0
  uniform = len(set(load)) == 1
  assert (v == 0.0) == (uniform or sum(load) == 0)
  h = float(M.load_entropy(jnp.array(load, jnp.float32)))
  assert -1e-6 <= h <= 1 + 1e-6
  if sum(load):
    assert (abs(h - 1) < 1e-6) == uniform


metrics_jit = jax.jit(lambda r: (M.expert_load(r, 4), M.coactivation(r, 4),
                                 M.active_experts(r, 4)[0]))


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(seed=st.integers(0, 10_000))
def test_load_coactivation_consistency(seed):
  t, k, e_r = 8, 3, 6
  rng = np.random.default_rng(seed)
  ids = np.stack([rng.choice(e_r, size=k, replace=False) for _ in range(t)])
  valid = rng.random((t, k)) < 0.8
  load, co, count = (np.asarray(x) for x in metrics_jit(make_result(ids, uniform_probs(t, e_r),
                                                                     valid=valid)))
  np.testing.assert_array_equal(load.sum(), (valid & (ids < 4)).sum())
  np.testing.assert_array_equal(count.sum(), load.sum())
  np.testing.assert_array_equal(co, co.T)
  np.testing.assert_array_equal(np.diag(co), load)
  assert np.all(co <= np.minimum(load[:, None], load[None, :]))


def test_soft_metrics_by_hand():
  cfg = moe_config("soft", num_experts=2, slots_per_expert=1)
  even = jnp.array([[[0.75, 0.25], [0.25, 0.75]]])  # [B=1, S=2, P=2]
  m = M.soft_metrics(even, even, cfg)
  np.testing.assert_allclose(m.load, [1.0, 1.0])
  assert float(m.max_vio) == 0.0
  h = -(0.75 * np.log(0.75) + 0.25 * np.log(0.25)) / np.log(2)  # 0.811
  np.testing.assert_allclose([m.dispatch_entropy, m.combine_entropy], [h, h], rtol=1e-6)
  # Every token puts its whole output on expert 0's slot.
  skew = jnp.array([[[1.0, 0.0], [1.0, 0.0]]])
  m = M.soft_metrics(jnp.full((1, 2, 2), 0.5), skew, cfg)
  np.testing.assert_allclose(m.load, [2.0, 0.0])
  assert float(m.max_vio) == 1.0 and float(m.load_entropy) == 0.0
  assert float(m.combine_entropy) == 0.0 and float(m.dispatch_entropy) == 1.0


def test_peer_metrics_by_hand():
  cfg = moe_config("peer", peer_num_keys=2, peer_heads=1, peer_top_k=2, peer_key_dim=4)
  ids = jnp.array([[[0, 1]], [[0, 0]]], jnp.int32)  # [T=2, H=1, k=2] of N=4 experts
  m = M.peer_metrics(ids, cfg)
  assert float(m.experts_touched) == 0.5          # experts 0 and 1 of 4
  np.testing.assert_allclose(m.max_vio, 2.0)      # counts [3, 1, 0, 0]: (3 - 1) / 1
  # Sub-keys: first half a = id // 2 -> [4, 0]; second b = id % 2 -> [3, 1].
  np.testing.assert_allclose(m.key_max_vio, 1.0)  # [4, 0, 3, 1]: (4 - 2) / 2
