"""Hierarchical routing: families, then experts inside the chosen families."""

import math

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from moejax.routing.hierarchical import select_hierarchical
from tests.routing.util import PROPS, log_rows, make_cfg, random_logits

# 2 tokens, F=2 families of 2 experts (family 0 = experts 0, 1; family 1 = 2, 3).
FAMILY = [[0.3, 0.7],
          [0.45, 0.55]]
WITHIN = [[0.9, 0.1, 0.4, 0.6],     # P(e | f) inside each family
          [0.95, 0.05, 0.5, 0.5]]
JOINT = [[0.27, 0.03, 0.28, 0.42],
         [0.4275, 0.0225, 0.275, 0.275]]


def _expert_logits():
  # Family 1's logits are shifted by +3: P(e|f) is a softmax within the family,
  # so a per-family shift must not matter.
  return log_rows(WITHIN) + np.array([0.0, 0.0, 3.0, 3.0], np.float32)


@pytest.mark.parametrize("gating,weights", [
    ("scores", [[0.42, 0.28], [0.275, 0.275]]),
    ("normalized", [[0.6, 0.4], [0.5, 0.5]]),
    ("topk_softmax", [[0.6, 0.4], [0.5, 0.5]]),
])
def test_hand_case(gating, weights):
  cfg = make_cfg(kind="hierarchical", n_families=2, top_k_families=1, top_k=2, gating=gating)
  r = select_hierarchical(log_rows(FAMILY), _expert_logits(), cfg)
  # Token 1's best expert overall is 0 (0.4275), but family 1 (0.55) wins first.
  np.testing.assert_array_equal(r.expert_ids, [[3, 2], [2, 3]])
  np.testing.assert_allclose(r.weights, weights, rtol=1e-5)
  np.testing.assert_allclose(r.probs, JOINT, rtol=1e-5)
  np.testing.assert_allclose(r.logits, _expert_logits())


def test_two_families_allows_the_global_best():
  cfg = make_cfg(kind="hierarchical", n_families=2, top_k_families=2, top_k=1, gating="scores")
  r = select_hierarchical(log_rows(FAMILY), _expert_logits(), cfg)
  np.testing.assert_array_equal(r.expert_ids, [[3], [0]])
  np.testing.assert_allclose(r.weights, [[0.42], [0.4275]], rtol=1e-5)


@PROPS
@hypothesis.given(fam=st.sampled_from([(2, 1), (4, 2), (8, 3)]), k=st.sampled_from([1, 3]),
                  score_fn=st.sampled_from(["softmax", "sigmoid"]),
                  gating=st.sampled_from(["scores", "normalized"]),
                  scale=st.sampled_from([1.0, 2.5]), seed=st.integers(0, 2**16))
def test_experts_only_inside_chosen_families(fam, k, score_fn, gating, scale, seed):
  f, kf = fam
  t, e = 6, 8
  k = min(k, (e // f) * kf)
  cfg = make_cfg(num_experts=e, kind="hierarchical", n_families=f, top_k_families=kf, top_k=k,
                 score_fn=score_fn, gating=gating, routed_scaling_factor=scale)
  fam_logits, exp_logits = random_logits(seed, t, f), random_logits(seed + 1, t, e)
  r = select_hierarchical(fam_logits, exp_logits, cfg)
  ids, p = np.asarray(r.expert_ids), np.asarray(r.probs)
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
  p_fam = p.reshape(t, f, e // f).sum(-1)
  for t_ in range(t):
    top_fams = set(np.argsort(-p_fam[t_], kind="stable")[:kf])
    assert set(ids[t_] // (e // f)) <= top_fams
    assert len(set(ids[t_])) == k
  total = np.asarray(r.weights.sum(-1))
  if gating == "normalized":
    np.testing.assert_allclose(total, scale, rtol=1e-5)
  else:
    np.testing.assert_allclose(total, scale * np.take_along_axis(p, ids, -1).sum(-1), rtol=1e-5)
  assert math.isfinite(float(total.sum()))
