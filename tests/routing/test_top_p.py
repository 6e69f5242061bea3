"""Top-p dynamic routing (Huang et al. 2403.07652)."""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np

from moejax.routing.top_p import select_top_p
from tests.routing.util import PROPS, log_rows, make_cfg, random_logits

# top_p = 0.7, max k = 3.
PROBS = [[0.05, 0.75, 0.1, 0.1],   # 0.75 >= 0.7 after one expert
         [0.3, 0.1, 0.45, 0.15],   # 0.45 < 0.7, then 0.75: two experts
         [0.3, 0.25, 0.1, 0.35]]   # 0.35, 0.65 < 0.7, then 0.9: three experts (the cap)


def test_hand_case_paper_gates():
  r = select_top_p(log_rows(PROBS), None, make_cfg(kind="top_p", top_k=3, top_p=0.7,
                                                   gating="scores"))
  np.testing.assert_array_equal(r.valid, [[True, False, False],
                                          [True, True, False],
                                          [True, True, True]])
  np.testing.assert_array_equal(r.expert_ids, [[1, 0, 0], [2, 0, 0], [3, 0, 1]])
  np.testing.assert_allclose(r.weights, [[0.75, 0, 0], [0.45, 0.3, 0], [0.35, 0.3, 0.25]],
                             rtol=1e-6)
  np.testing.assert_allclose(r.probs, PROBS, rtol=1e-6)


def test_hand_case_normalized_gates():
  r = select_top_p(log_rows(PROBS), None, make_cfg(kind="top_p", top_k=3, top_p=0.7,
                                                   gating="normalized"))
  np.testing.assert_allclose(r.weights, [[1, 0, 0], [0.6, 0.4, 0],
                                         [0.35 / 0.9, 0.3 / 0.9, 0.25 / 0.9]], rtol=1e-6)


def test_hand_case_capped_below_threshold():
  # max k = 2 stops at 0.4 + 0.3 = 0.7 < 0.9.
  r = select_top_p(log_rows([[0.4, 0.3, 0.2, 0.1]]), None,
                   make_cfg(kind="top_p", top_k=2, top_p=0.9, gating="scores"))
  np.testing.assert_array_equal(r.valid, [[True, True]])
  np.testing.assert_array_equal(r.expert_ids, [[0, 1]])


def test_stops_when_mass_reaches_threshold_exactly():
  # Uniform over 4 experts: p = 0.25 exactly. Two experts reach 0.5 = top_p, so the
  # third is not added ("until cumulative >= top_p").
  r = select_top_p(jnp.zeros((1, 4)), None, make_cfg(kind="top_p", top_k=4, top_p=0.5,
                                                     gating="scores"))
  np.testing.assert_array_equal(r.valid, [[True, True, False, False]])
  np.testing.assert_array_equal(r.expert_ids, [[0, 1, 0, 0]])
  np.testing.assert_allclose(r.weights, [[0.25, 0.25, 0, 0]])


def test_top_p_one_takes_everything_up_to_k():
  r = select_top_p(log_rows(PROBS), None, make_cfg(kind="top_p", top_k=4, top_p=1.0))
  assert r.valid.all()


@PROPS
@hypothesis.given(k=st.sampled_from([1, 3, 8]), top_p=st.floats(0.05, 1.0),
                  score_fn=st.sampled_from(["softmax", "sigmoid"]),
                  gating=st.sampled_from(["scores", "normalized"]),
                  use_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_threshold_met_unless_capped(k, top_p, score_fn, gating, use_bias, seed):
  t, e = 6, 8
  cfg = make_cfg(num_experts=e, kind="top_p", top_k=k, top_p=top_p, score_fn=score_fn,
                 gating=gating, use_bias=use_bias)
  logits = random_logits(seed, t, e)
  bias = jnp.asarray(np.random.default_rng(seed).normal(0, 0.2, (e,)), jnp.float32)
  r = select_top_p(logits, bias, cfg)
  valid, ids, p = np.asarray(r.valid), np.asarray(r.expert_ids), np.asarray(r.probs)
  w = np.asarray(r.weights)
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
  for t_ in range(t):
    n = valid[t_].sum()
    assert n >= 1 and valid[t_, :n].all()  # the included experts are a prefix
    mass = p[t_, ids[t_, :n]].sum()
    if n < k:
      assert mass >= top_p - 1e-6
    # Minimal: without its last expert the token was still below the threshold.
    assert p[t_, ids[t_, :n - 1]].sum() < top_p + 1e-6
    assert len(set(ids[t_, :n])) == n
    assert (w[t_, n:] == 0).all() and (ids[t_, n:] == 0).all()
    if gating == "normalized":
      np.testing.assert_allclose(w[t_].sum(), 1.0, rtol=1e-5)
