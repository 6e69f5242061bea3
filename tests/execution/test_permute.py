"""Dropless dispatch: sort by expert, permute / unpermute and their VJPs."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.execution import permute as P

# T=4 tokens, K=2 slots, E=3 FFN experts; id 3 is a zero-computation expert.
IDS = jnp.array([[1, 0], [1, 2], [0, 3], [2, 1]], jnp.int32)
VALID = jnp.array([[True, True], [True, True], [True, True], [True, False]])


def test_sort_by_expert_hand_computed():
  plan = P.sort_by_expert(IDS, VALID, num_experts=3)
  # Routed copies, token-major: (0,1)->e0 (2,0)->e0 | (0,0)->e1 (1,0)->e1 |
  # (1,1)->e2 (3,0)->e2; (2,1) is zero-computation and (3,1) invalid.
  np.testing.assert_array_equal(plan.group_sizes, [2, 2, 2])
  np.testing.assert_array_equal(plan.src_token, [0, 2, 0, 1, 1, 3, 4, 4])
  np.testing.assert_array_equal(plan.src_slot, [1, 4, 0, 2, 3, 6, 8, 8])
  np.testing.assert_array_equal(plan.dst, [[2, 0], [3, 4], [1, 8], [5, 8]])
  np.testing.assert_array_equal(plan.dispatched(),
                                [[1, 1], [1, 1], [1, 0], [1, 0]])


@pytest.mark.parametrize("m,bound", [(1, 1), (7, 2), (64, 5), (4096, 17), (300, 2**31 // 300 + 1)])
def test_stable_order_is_the_stable_argsort(m, bound):
  # The last case packs past int32 and takes the argsort fallback.
  key = jnp.asarray(np.random.default_rng(m).integers(0, min(bound, 9), m), jnp.int32)
  order = jax.jit(P.stable_order, static_argnums=1)(key, bound)
  assert order.dtype == jnp.int32
  np.testing.assert_array_equal(order, np.argsort(np.asarray(key), kind="stable"))


def test_permute_rows_and_zero_padding():
  x = jnp.arange(4.0)[:, None] * jnp.ones((1, 2)) + 1  # token t -> row of t+1
  plan = P.sort_by_expert(IDS, VALID, num_experts=3)
  xs = P.permute(x, plan)
  np.testing.assert_array_equal(xs[:, 0], [1, 3, 1, 2, 2, 4, 0, 0])


def test_round_trip_weights_the_dispatched_copies():
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 5))
  w = jnp.array([[0.5, 0.25], [1.0, 2.0], [3.0, 7.0], [0.125, 9.0]])
  plan = P.sort_by_expert(IDS, VALID, num_experts=3)
  y = P.unpermute(P.permute(x, plan), plan, w)
  # Dispatched weight per token: slot (2,1) (zero-computation) and (3,1)
  # (invalid) are not dispatched, so their weights do not count.
  np.testing.assert_allclose(y, x * jnp.array([0.75, 3.0, 3.0, 0.125])[:, None], rtol=1e-6)


def _naive(x, ys_fn, w, plan):
  """One-hot matrices: xs = S x, y[t] = sum_k w[t,k] (D[t,k] ys)."""
  r, t = plan.num_rows, x.shape[0]
  s = jax.nn.one_hot(plan.src_token, t)  # [R, T]; out-of-range rows are 0
  d = jax.nn.one_hot(plan.dst, r)  # [T, K, R]
  ys = ys_fn(s @ x)
  return jnp.einsum("tk,tkr,rd->td", w, d, ys)


@pytest.mark.parametrize("gather", ["xla", "pallas_tpu", "pallas_gpu"])
def test_gradients_match_one_hot_reference(gather):
  kx, kw = jax.random.split(jax.random.PRNGKey(1))
  x = jax.random.normal(kx, (4, 3))
  w = jax.random.uniform(kw, (4, 2))
  plan = P.sort_by_expert(IDS, VALID, num_experts=3)
  scale = jnp.arange(1.0, 9.0)[:, None]  # a row-dependent "expert"
  kw_ = dict(backend=gather, interpret=gather != "xla")

  def fast(x, w):
    return jnp.sum(jnp.sin(P.unpermute(P.permute(x, plan, **kw_) * scale, plan, w, **kw_)))

  def naive(x, w):
    return jnp.sum(jnp.sin(_naive(x, lambda xs: xs * scale, w, plan)))

  np.testing.assert_allclose(fast(x, w), naive(x, w), rtol=1e-6)
  for g, want in zip(jax.grad(fast, (0, 1))(x, w), jax.grad(naive, (0, 1))(x, w)):
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_backward_is_gathers_not_scatters():
  plan = P.sort_by_expert(IDS, VALID, num_experts=3)
  x, w = jnp.ones((4, 3)), jnp.ones((4, 2))
  grad = jax.grad(lambda x, w: jnp.sum(P.unpermute(P.permute(x, plan) ** 2, plan, w)),
                  (0, 1))
  jaxpr = str(jax.make_jaxpr(grad)(x, w))
  assert "gather" in jaxpr
  assert "scatter" not in jaxpr


def test_bad_inputs():
  plan = P.sort_by_expert(IDS, VALID, num_experts=3)
  with pytest.raises(ValueError, match=r"x \(5, 3\) must be \[T=4, d\]"):
    P.permute(jnp.ones((5, 3)), plan)
  with pytest.raises(ValueError, match=r"ys \(7, 3\) must be \[R=8, d\]"):
    P.unpermute(jnp.ones((7, 3)), plan, jnp.ones((4, 2)))
  with pytest.raises(ValueError, match="gather backend 'cuda'"):
    P.permute(jnp.ones((4, 3)), plan, backend="cuda")
  with pytest.raises(ValueError, match="must both be"):
    P.sort_by_expert(IDS, VALID[:, :1], num_experts=3)
  if jax.default_backend() != "tpu":
    with pytest.raises(ValueError, match="needs a TPU.*interpret=True"):
      P.permute(jnp.ones((4, 3)), plan, backend="pallas_tpu")
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="needs a GPU.*interpret=True"):
      P.permute(jnp.ones((4, 3)), plan, backend="pallas_gpu")


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(st.data())
def test_sorted_layout_properties(data):
  t, k, e = 6, 3, 4
  ids = jnp.array(data.draw(st.lists(st.integers(0, e + 1), min_size=t * k,
                                     max_size=t * k)), jnp.int32).reshape(t, k)
  valid = jnp.array(data.draw(st.lists(st.booleans(), min_size=t * k,
                                       max_size=t * k))).reshape(t, k)
  plan = jax.jit(P.sort_by_expert, static_argnums=2)(ids, valid, e)
  routed = np.asarray(valid & (ids < e))
  counts = np.bincount(np.asarray(ids)[routed], minlength=e)
  np.testing.assert_array_equal(plan.group_sizes, counts)
  n = int(routed.sum())
  src_slot = np.asarray(plan.src_slot)
  # Every routed slot owns exactly one row, the rows are sorted by expert,
  # dst and src are inverse maps, the tail rows are empty.
  np.testing.assert_array_equal(np.sort(src_slot[:n]), np.flatnonzero(routed.reshape(-1)))
  row_expert = np.asarray(ids).reshape(-1)[src_slot[:n]]
  assert np.all(np.diff(row_expert) >= 0)
  dst = np.asarray(plan.dst).reshape(-1)
  np.testing.assert_array_equal(dst[src_slot[:n]], np.arange(n))
  assert np.all(dst[~routed.reshape(-1)] == t * k)
  assert np.all(src_slot[n:] == t * k) and np.all(np.asarray(plan.src_token)[n:] == t)


def test_row_gathers_are_objects_that_say_where_they_run():
  assert tuple(P.ROW_GATHERS) == P.GATHER_BACKENDS
  assert [g.name for g in P.ROW_GATHERS.values() if g.foldable] == ["xla"]
  assert P.get_gather("pallas_tpu", interpret=True).platform == "tpu"
  with pytest.raises(ValueError, match="'palas_tpu' is unknown.*xla, pallas_tpu"):
    P.get_gather("palas_tpu")
  x = jnp.arange(6.0).reshape(3, 2)
  out = P.gather_rows(x, jnp.array([2, 3, 0], jnp.int32))
  np.testing.assert_array_equal(out, [[4.0, 5.0], [0.0, 0.0], [0.0, 1.0]])
