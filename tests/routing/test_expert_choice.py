"""Expert-choice routing (Zhou et al. 2202.09368)."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from moejax.routing.expert_choice import tokens_per_expert, select_expert_choice
from tests.routing.util import PROPS, log_rows, make_cfg, random_logits


@pytest.mark.parametrize("t,e,c,want", [
    (8, 4, 2.0, 4),     # exact: 8 * 2 / 4
    (10, 4, 1.0, 3),    # 2.5 rounds half up
    (10, 4, 0.9, 2),    # 2.25 -> 2
    (10, 4, 0.2, 1),    # 0.5 -> 1
    (6, 4, 0.1, 1),     # 0.15 -> 0, clipped to at least 1
    (4, 2, 8.0, 4),     # 16, clipped to at most T
])
def test_capacity_rounding(t, e, c, want):
  assert tokens_per_expert(t, e, c) == want


def test_hand_case_token_with_two_experts_and_token_with_none():
  # T=3, E=3, c=1 -> C=1: each expert takes its single best token.
  # Column maxima: expert 0 -> t0 (.5), expert 1 -> t0 (.4), expert 2 -> t1 (.6).
  probs = [[0.5, 0.4, 0.1],
           [0.3, 0.1, 0.6],
           [0.4, 0.3, 0.3]]
  r = select_expert_choice(log_rows(probs), make_cfg(num_experts=3, kind="expert_choice",
                                                     capacity=1.0))
  np.testing.assert_array_equal(r.valid, [[True, True, False],
                                          [False, False, True],
                                          [False, False, False]])
  np.testing.assert_array_equal(r.expert_ids, [[0, 1, 0], [0, 0, 2], [0, 0, 0]])
  np.testing.assert_allclose(r.weights, [[0.5, 0.4, 0], [0, 0, 0.6], [0, 0, 0]], rtol=1e-6)
  np.testing.assert_allclose(r.probs, probs, rtol=1e-6)


def test_hand_case_capacity_two():
  # T=4, E=2, c=1 -> C=2. Expert 0 takes t0 (.9), t1 (.6); expert 1 takes t3 (.8), t2 (.7).
  probs = [[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]]
  cfg = make_cfg(num_experts=2, kind="expert_choice", capacity=1.0,
                 routed_scaling_factor=2.0)
  r = select_expert_choice(log_rows(probs), cfg)
  np.testing.assert_array_equal(r.valid, [[True, False], [True, False],
                                          [False, True], [False, True]])
  np.testing.assert_array_equal(r.expert_ids, [[0, 0], [0, 0], [0, 1], [0, 1]])
  np.testing.assert_allclose(r.weights, 2.0 * np.array([[0.9, 0], [0.6, 0], [0, 0.7], [0, 0.8]]),
                             rtol=1e-6)


@PROPS
@hypothesis.given(t=st.sampled_from([8, 13]), e=st.sampled_from([4, 8]),
                  c=st.sampled_from([0.5, 3.0]),
                  score_fn=st.sampled_from(["softmax", "sigmoid"]), seed=st.integers(0, 2**16))
def test_each_expert_gets_exactly_its_capacity(t, e, c, score_fn, seed):
  cfg = make_cfg(num_experts=e, kind="expert_choice", capacity=c,
                 score_fn=score_fn)
  logits = random_logits(seed, t, e)
  r = select_expert_choice(logits, cfg)
  cap = tokens_per_expert(t, e, c)
  assert r.expert_ids.shape == r.weights.shape == r.valid.shape == (t, e)
  valid = np.asarray(r.valid)
  np.testing.assert_array_equal(valid.sum(0), cap)
  np.testing.assert_allclose(r.probs.sum(-1), 1.0, rtol=1e-5)
  # Slot e is expert e; weights are the scores where chosen, 0 elsewhere.
  np.testing.assert_array_equal(np.asarray(r.expert_ids), np.where(valid, np.arange(e), 0))
  s = np.asarray(r.probs) if score_fn == "softmax" else 1 / (1 + np.exp(-np.asarray(logits)))
  np.testing.assert_allclose(r.weights, np.where(valid, s, 0), rtol=1e-5)
  # Each expert's chosen tokens score at least as high as its unchosen ones.
  for ex in range(e):
    chosen, rest = s[valid[:, ex], ex], s[~valid[:, ex], ex]
    assert rest.size == 0 or chosen.min() >= rest.max()


def test_scope_batch_chooses_among_the_whole_split_batch_scope_group_per_shard():
  """4 shards of 4 tokens over a named axis: 'batch' = the 16 together, 'group' = each alone."""
  import jax
  import jax.numpy as jnp
  from moejax.routing import ROUTERS
  from moejax.routing.types import RoutingContext
  # Expert 0 likes the first shard's tokens best: a batch-wide choice takes them all.
  logits = random_logits(5, 16, 4) + jnp.zeros((16, 4)).at[:4, 0].set(10.0)
  shards = logits.reshape(4, 4, 4)
  cfgs = {scope: make_cfg(num_experts=4, kind="expert_choice", capacity=1.0, scope=scope)
          for scope in ("batch", "group")}
  whole = select_expert_choice(logits, cfgs["batch"])
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(select_expert_choice(
      logits, cfgs["group"]))):
    np.testing.assert_array_equal(a, b)  # one device: the scopes agree

  def split(scope):
    r = jax.vmap(lambda z: select_expert_choice(z, cfgs[scope], RoutingContext.build(
        4, "shard")), axis_name="shard")(shards)
    return jax.tree.map(lambda a: a.reshape((16,) + a.shape[2:]), r)

  for a, b in zip(jax.tree.leaves(split("batch")), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(a, b)
  valid = np.asarray(whole.valid)
  assert valid[:4, 0].all() and valid.sum(0).tolist() == [4] * 4
  group = np.asarray(split("group").valid).reshape(4, 4, 4)  # each shard alone, C = 1
  alone = jax.vmap(lambda z: select_expert_choice(z, cfgs["group"]))(shards)
  np.testing.assert_array_equal(group, alone.valid)
  assert group.sum(1).tolist() == [[1] * 4] * 4
  spec = ROUTERS.get("expert_choice")
  assert spec.batch_wide and spec.reads_context and spec.why_not_expert_parallel == ""


def test_scope_is_checked():
  import pytest
  from moejax import config as C
  with pytest.raises(C.ConfigError, match=r"^moe\.routing\.options\.scope='sequence': unknown "
                                          r"value\. Fix: use one of group, batch"):
    make_cfg(kind="expert_choice", scope="sequence")
