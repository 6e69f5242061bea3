"""[E, C] capacity buffers: the slot-major drop rule, dispatch and combine."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from moejax.balance import capacity as capacity_lib
from moejax.execution import permute as P
from moejax.routing.types import RoutingResult

# T=4, K=2, E=2, C=2. Slot-major priority: k=0 first: t0->e0, t1->e0,
# t2->e1, t3->e0; then k=1: t0->e1, t1->e1, t2->e0, t3->e1.
IDS = jnp.array([[0, 1], [0, 1], [1, 0], [0, 1]], jnp.int32)
VALID = jnp.ones((4, 2), bool)


def test_drops_follow_slot_major_priority():
  plan = P.capacity_layout(IDS, VALID, num_experts=2, capacity=2)
  # e0 keeps (t0,k0) (t1,k0) and drops (t3,k0) (t2,k1); e1 keeps (t2,k0)
  # (t0,k1) and drops (t1,k1) (t3,k1). A token-major rule would keep
  # (t0,k1) on e1 ahead of (t2,k0): not this one.
  np.testing.assert_array_equal(plan.dst, [[0, 3], [1, 4], [2, 4], [4, 4]])
  np.testing.assert_array_equal(plan.dispatched(), [[1, 1], [1, 0], [1, 0], [0, 0]])
  np.testing.assert_array_equal(plan.src_token, [0, 1, 2, 0])
  np.testing.assert_array_equal(plan.src_slot, [0, 2, 4, 1])
  np.testing.assert_array_equal(plan.group_sizes, [2, 2])


def test_buffers_and_combine():
  x = jnp.arange(1.0, 5.0)[:, None] * jnp.ones((1, 3))
  plan = P.capacity_layout(IDS, VALID, num_experts=2, capacity=3)
  # The expert-parallel executor's view of the plan: [E, C, d] buffers.
  buf = P.permute(x, plan).reshape(2, 3, 3)
  # e0: (t0,k0) (t1,k0) (t3,k0) kept, (t2,k1) dropped; e1: (t2,k0) (t0,k1) (t1,k1).
  np.testing.assert_array_equal(buf[:, :, 0], [[1, 2, 4], [3, 1, 2]])
  w = jnp.array([[1.0, 10.0], [1.0, 10.0], [1.0, 10.0], [1.0, 10.0]])
  y = P.unpermute((buf * 2).reshape(6, 3), plan, w)
  # Kept weight per token: t0 11, t1 11, t2 1 (k1 dropped), t3 1 (k1 dropped).
  np.testing.assert_allclose(y[:, 0], 2 * np.array([1, 2, 3, 4]) * [11, 11, 1, 1])


def test_zero_capacity_drops_everything_and_empty_rows_are_zero():
  plan = P.capacity_layout(IDS, VALID, num_experts=2, capacity=0)
  assert plan.num_rows == 0 and not np.any(plan.dispatched())
  plan = P.capacity_layout(IDS, VALID.at[:, 1].set(False), num_experts=2, capacity=3)
  buf = P.permute(jnp.ones((4, 2)), plan).reshape(2, 3, 2)
  np.testing.assert_array_equal(buf[:, :, 0], [[1, 1, 1], [1, 0, 0]])


def test_large_capacity_equals_the_dropless_layout():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  ids = jax.random.randint(k1, (16, 3), 0, 5)
  valid = jax.random.uniform(k2, (16, 3)) > 0.2
  x = jax.random.normal(k3, (16, 4))
  w = jax.random.uniform(k3, (16, 3))
  cap = P.capacity_layout(ids, valid, num_experts=4, capacity=48)
  free = P.sort_by_expert(ids, valid, num_experts=4)
  assert not np.any(np.asarray(cap.dispatched()) != np.asarray(free.dispatched()))

  def through(plan):
    return lambda x, w: jnp.sum(jnp.cos(P.unpermute(jnp.tanh(P.permute(x, plan)), plan, w)))

  for a, b in zip(jax.grad(through(cap), (0, 1))(x, w), jax.grad(through(free), (0, 1))(x, w)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(st.data())
def test_drops_agree_with_balance_apply_capacity(data):
  t, k, e = 6, 2, 3
  ids = jnp.array(data.draw(st.lists(st.integers(0, e), min_size=t * k, max_size=t * k)),
                  jnp.int32).reshape(t, k)
  valid = jnp.array(data.draw(st.lists(st.booleans(), min_size=t * k,
                                       max_size=t * k))).reshape(t, k)
  c = data.draw(st.integers(0, 5))
  plan = jax.jit(P.capacity_layout, static_argnums=(2, 3))(ids, valid, e, c)
  w = jnp.where(valid, 0.5, 0.0)
  result = RoutingResult(expert_ids=ids, weights=w, valid=valid,
                         probs=jnp.full((t, e + 1), 1.0 / (e + 1)), logits=jnp.zeros((t, e + 1)))
  _, dropped = capacity_lib.apply_capacity(result, c, num_experts=e, priority="position")
  routed = np.asarray(valid & (ids < e))
  np.testing.assert_array_equal(np.asarray(plan.dispatched()), routed & ~np.asarray(dropped))
