"""Token-choice top-k routing: hand cases and properties."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.routing.gating import gate_weights
from moejax.routing.scores import scores
from moejax.routing.topk import select_topk
from tests.routing.util import PROPS, log_rows, make_cfg, random_logits

# 3 tokens x 4 experts; softmax of these logits is exactly the rows.
PROBS = [[0.1, 0.4, 0.3, 0.2],
         [0.25, 0.25, 0.4, 0.1],   # tie 0/1: lax.top_k prefers the lower index
         [0.7, 0.05, 0.05, 0.2]]
IDS = [[1, 2], [2, 0], [0, 3]]


def test_softmax_top2_normalized_hand():
  r = select_topk(log_rows(PROBS), None, make_cfg(top_k=2, gating="normalized"))
  np.testing.assert_array_equal(r.expert_ids, IDS)
  np.testing.assert_allclose(r.weights, [[4 / 7, 3 / 7], [8 / 13, 5 / 13], [7 / 9, 2 / 9]],
                             rtol=1e-6)
  assert r.valid.all()
  np.testing.assert_allclose(r.probs, PROBS, rtol=1e-6)
  np.testing.assert_allclose(r.logits, log_rows(PROBS))


def test_mixtral_topk_softmax_hand():
  # softmax over the two selected logits: log(0.4), log(0.3) -> 4/7, 3/7.
  r = select_topk(log_rows(PROBS), None, make_cfg(top_k=2, gating="topk_softmax"))
  np.testing.assert_array_equal(r.expert_ids, IDS)
  np.testing.assert_allclose(r.weights, [[4 / 7, 3 / 7], [8 / 13, 5 / 13], [7 / 9, 2 / 9]],
                             rtol=1e-6)


def test_qwen_unnormalized_scores_hand():
  r = select_topk(log_rows(PROBS), None, make_cfg(top_k=2, gating="scores"))
  np.testing.assert_allclose(r.weights, [[0.4, 0.3], [0.4, 0.25], [0.7, 0.2]], rtol=1e-6)


def test_switch_top1_is_k1_softmax_scores():
  """Switch: the gate is the softmax prob of the argmax expert, not renormalised to 1."""
  r = select_topk(log_rows(PROBS), None, make_cfg(top_k=1, gating="scores"))
  np.testing.assert_array_equal(r.expert_ids, [[1], [2], [0]])
  np.testing.assert_allclose(r.weights, [[0.4], [0.4], [0.7]], rtol=1e-6)
  # With 'normalized' a top-1 gate would be exactly 1: a different model.
  r1 = select_topk(log_rows(PROBS), None, make_cfg(top_k=1, gating="normalized"))
  np.testing.assert_allclose(r1.weights, [[1.0], [1.0], [1.0]])


def test_routed_scaling_factor_hand():
  r = select_topk(log_rows(PROBS), None,
                  make_cfg(top_k=2, gating="normalized", routed_scaling_factor=2.5))
  np.testing.assert_allclose(r.weights[0], [10 / 7, 7.5 / 7], rtol=1e-6)


def test_bias_moves_selection_not_gates_hand():
  """A large bias on expert 3 puts it in every token's top-2; gates stay unbiased."""
  cfg = make_cfg(top_k=2, gating="scores", use_bias=True)
  bias = jnp.array([0.0, 0.0, 0.0, 10.0])
  r = select_topk(log_rows(PROBS), bias, cfg)
  np.testing.assert_array_equal(r.expert_ids, [[3, 1], [3, 2], [3, 0]])
  np.testing.assert_allclose(r.weights, [[0.2, 0.4], [0.1, 0.4], [0.2, 0.7]], rtol=1e-6)
  # use_bias=False ignores a bias that is passed.
  r0 = select_topk(log_rows(PROBS), bias, make_cfg(top_k=2, gating="scores"))
  np.testing.assert_array_equal(r0.expert_ids, IDS)


# Sigmoid + bias (DeepSeek-V3), 1 token, 8 experts in 4 groups of 2.
S = [[0.9, 0.1, 0.6, 0.55, 0.2, 0.15, 0.65, 0.4]]
BIAS = jnp.array([0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0])


def _sigmoid_logits(rows):
  s = np.asarray(rows, np.float64)
  return jnp.asarray(np.log(s / (1 - s)), jnp.float32)


def test_deepseek_v3_bias_without_groups_hand():
  # biased = [.9, .1, .6, .55, .7, .65, .65, .4] -> top-2 {0, 4}; gates from s: [.9, .2]/1.1.
  cfg = make_cfg(num_experts=8, top_k=2, score_fn="sigmoid", use_bias=True,
                 routed_scaling_factor=2.5)
  r = select_topk(_sigmoid_logits(S), BIAS, cfg)
  np.testing.assert_array_equal(r.expert_ids, [[0, 4]])
  np.testing.assert_allclose(r.weights, [[2.5 * 0.9 / 1.1, 2.5 * 0.2 / 1.1]], rtol=1e-5)
  np.testing.assert_allclose(r.probs, np.asarray(S) / 3.55, rtol=1e-5)


@pytest.mark.parametrize("use_bias,group_score,ids,gates", [
    # biased group top-2 sums [1.0, 1.15, 1.35, 1.05] -> groups {2, 1} -> experts {4, 5}
    # (biased .7, .65) although expert 0 has the best score.
    (True, "auto", [4, 5], [0.2 / 0.35, 0.15 / 0.35]),
    # no bias, auto = max (DeepSeek-V2): group maxima [.9, .6, .2, .65] -> groups {0, 3}.
    (False, "auto", [0, 6], [0.9 / 1.55, 0.65 / 1.55]),
    # no bias, top2_sum: [1.0, 1.15, 0.35, 1.05] -> groups {1, 3} -> experts 6, 2.
    (False, "top2_sum", [6, 2], [0.65 / 1.25, 0.6 / 1.25]),
    (True, "max", [0, 4], [0.9 / 1.1, 0.2 / 1.1]),  # biased maxima [.9, .6, .7, .65] -> {0, 2}
])
def test_group_limited_hand(use_bias, group_score, ids, gates):
  cfg = make_cfg(num_experts=8, top_k=2, score_fn="sigmoid", use_bias=use_bias, n_groups=4,
                 topk_groups=2, group_score=group_score)
  r = select_topk(_sigmoid_logits(S), BIAS, cfg)
  np.testing.assert_array_equal(r.expert_ids, [ids])
  np.testing.assert_allclose(r.weights, [gates], rtol=1e-5)


def test_group_mask_beats_negative_biased_scores():
  """Masked experts must lose even when every surviving key is negative."""
  cfg = make_cfg(num_experts=4, top_k=2, score_fn="sigmoid", use_bias=True, n_groups=2,
                 topk_groups=1, group_score="max")
  logits = _sigmoid_logits([[0.5, 0.5, 0.6, 0.4]])
  r = select_topk(logits, jnp.array([-5.0, -5.0, -3.0, -3.0]), cfg)
  np.testing.assert_array_equal(r.expert_ids, [[2, 3]])


# ---------------------------------------------------------------------------
# Properties.

@st.composite
def topk_case(draw):
  e = 8  # fixed shapes keep JAX's per-shape op cache warm; T=6 rows are 6 cases
  score_fn = draw(st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]))
  gatings = ["scores", "normalized"] + (["topk_softmax"] if score_fn == "softmax" else [])
  return dict(t=6, e=e, k=draw(st.sampled_from([1, 2, 3, e])),
              score_fn=score_fn, gating=draw(st.sampled_from(gatings)),
              scale=draw(st.sampled_from([1.0, 2.5])), seed=draw(st.integers(0, 2**16)))


@PROPS
@hypothesis.given(topk_case())
def test_topk_properties(c):
  cfg = make_cfg(num_experts=c["e"], top_k=c["k"], score_fn=c["score_fn"], gating=c["gating"],
                 routed_scaling_factor=c["scale"])
  logits = random_logits(c["seed"], c["t"], c["e"])
  r = select_topk(logits, None, cfg)
  assert r.expert_ids.shape == r.weights.shape == r.valid.shape == (c["t"], c["k"])
  assert r.expert_ids.dtype == jnp.int32 and r.weights.dtype == jnp.float32
  assert r.probs.shape == r.logits.shape == (c["t"], c["e"])
  np.testing.assert_allclose(r.probs.sum(-1), 1.0, rtol=1e-5)
  ids = np.asarray(r.expert_ids)
  assert all(len(set(row)) == c["k"] for row in ids)
  s = np.asarray(scores(logits, c["score_fn"]))
  chosen = np.take_along_axis(s, ids, -1)
  # The chosen experts are the K best: the worst chosen beats every unchosen.
  for t in range(c["t"]):
    rest = np.delete(s[t], ids[t])
    assert rest.size == 0 or chosen[t].min() >= rest.max()
  total = np.asarray(r.weights.sum(-1))
  if c["gating"] == "scores":
    np.testing.assert_allclose(total, c["scale"] * chosen.sum(-1), rtol=1e-5)
  else:
    np.testing.assert_allclose(total, c["scale"], rtol=1e-5)


@PROPS
@hypothesis.given(k=st.sampled_from([1, 2, 3, 8]), seed=st.integers(0, 2**16))
def test_mixtral_equals_softmax_all_topk_renormalise(k, seed):
  t = 6
  """Softmax(TopK(logits)) == TopK(Softmax(logits)) / sum: exp(z_i)/Z cancels Z."""
  logits = random_logits(seed, t, 8, scale=3.0)
  r = select_topk(logits, None, make_cfg(num_experts=8, top_k=k, gating="topk_softmax"))
  p = np.asarray(jax.nn.softmax(logits, axis=-1))
  ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
  top = np.take_along_axis(p, ids, -1)
  np.testing.assert_array_equal(r.expert_ids, ids)
  np.testing.assert_allclose(r.weights, top / top.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


@PROPS
@hypothesis.given(k=st.sampled_from([1, 2, 4]),
                  score_fn=st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]),
                  gating=st.sampled_from(["scores", "normalized"]),
                  seed=st.integers(0, 2**16))
def test_bias_changes_selection_never_gates(k, score_fn, gating, seed):
  t, e = 6, 8
  cfg = make_cfg(num_experts=e, top_k=k, score_fn=score_fn, gating=gating, use_bias=True,
                 routed_scaling_factor=2.5)
  logits = random_logits(seed, t, e)
  bias = jnp.asarray(np.random.default_rng(seed + 1).normal(0, 1.0, (e,)), jnp.float32)
  r = select_topk(logits, bias, cfg)
  s = scores(logits, score_fn)
  # Selection is top-K of s + b ...
  key = np.asarray(s + bias)
  _, want = jax.lax.top_k(jnp.asarray(key), k)
  np.testing.assert_array_equal(r.expert_ids, want)
  # ... and gates are the unbiased gates of exactly those experts.
  unbiased = gate_weights(s, logits, r.expert_ids, r.valid, gating, 2.5)
  np.testing.assert_allclose(r.weights, unbiased, rtol=1e-6)
  # Same selection -> same gates as the bias-free router.
  r0 = select_topk(logits, None, make_cfg(num_experts=e, top_k=k, score_fn=score_fn,
                                          gating=gating, routed_scaling_factor=2.5))
  same = np.all(np.sort(np.asarray(r.expert_ids), -1) == np.sort(np.asarray(r0.expert_ids), -1),
                axis=-1)
  for t_ in np.nonzero(same)[0]:
    a = dict(zip(np.asarray(r.expert_ids[t_]), np.asarray(r.weights[t_])))
    b = dict(zip(np.asarray(r0.expert_ids[t_]), np.asarray(r0.weights[t_])))
    for ex in a:
      np.testing.assert_allclose(a[ex], b[ex], rtol=1e-6)


@PROPS
@hypothesis.given(
    groups=st.sampled_from([(2, 1), (4, 2), (4, 1), (8, 3), (4, 4)]),
    k=st.sampled_from([1, 2, 3]), use_bias=st.booleans(),
    group_score=st.sampled_from(["auto", "top2_sum", "max"]),
    seed=st.integers(0, 2**16))
def test_group_limits_respected(groups, k, use_bias, group_score, seed):
  g, tg = groups
  t, e = 6, 8
  k = min(k, (e // g) * tg)
  cfg = make_cfg(num_experts=e, top_k=k, score_fn="sigmoid", use_bias=use_bias, n_groups=g,
                 topk_groups=tg, group_score=group_score)
  logits = random_logits(seed, t, e)
  bias = jnp.asarray(np.random.default_rng(seed + 1).normal(0, 0.3, (e,)), jnp.float32)
  r = select_topk(logits, bias, cfg)
  ids = np.asarray(r.expert_ids)
  key = np.asarray(scores(logits, "sigmoid") + (bias if use_bias else 0))
  how = {"auto": "top2_sum" if use_bias else "max"}.get(group_score, group_score)
  grouped = np.sort(key.reshape(t, g, e // g), -1)[..., ::-1]
  gscore = grouped[..., :2].sum(-1) if how == "top2_sum" else grouped[..., 0]
  for t_ in range(t):
    spanned = set(ids[t_] // (e // g))
    assert len(spanned) <= tg
    # Every spanned group is among the top-tg groups by group score.
    cutoff = np.sort(gscore[t_])[::-1][tg - 1]
    assert all(gscore[t_, grp] >= cutoff for grp in spanned)
  np.testing.assert_allclose(r.weights.sum(-1), 1.0, rtol=1e-5)
