"""Sampling filters with hand-computed nuclei (moejax.serve.sampling)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.serve.sampling import (SamplingConfig, filtered_logits, sample, top_k_mask,
                                   top_p_mask)

# Probabilities 0.5, 0.3, 0.15, 0.05, listed out of order.
PROBS = np.array([[0.15, 0.5, 0.05, 0.3]])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))


@pytest.mark.parametrize("p,keep", [
    (0.5, [0, 1, 0, 0]),    # 0.5 alone reaches 0.5
    (0.7, [0, 1, 0, 1]),    # 0.5 + 0.3 = 0.8 >= 0.7
    (0.81, [1, 1, 0, 1]),   # 0.95 >= 0.81
    (0.01, [0, 1, 0, 0]),   # the most likely token is always kept
    (1.0, [1, 1, 1, 1]),
])
def test_top_p_mask_by_hand(p, keep):
  np.testing.assert_array_equal(top_p_mask(LOGITS, p)[0], np.asarray(keep, bool))


def test_top_k_mask_and_temperature():
  np.testing.assert_array_equal(top_k_mask(LOGITS, 2)[0], [False, True, False, True])
  np.testing.assert_array_equal(top_k_mask(LOGITS, 0)[0], [True] * 4)
  out = filtered_logits(LOGITS, SamplingConfig(temperature=2.0, top_k=3))
  np.testing.assert_allclose(out[0, :2], LOGITS[0, :2] / 2.0, rtol=1e-6)
  assert out[0, 2] == -jnp.inf
  # Temperature flattens the distribution before the nucleus is taken: at T=4,
  # probabilities ~ p^(1/4) = .28, .38, .21, .33 (normalised), so p=0.7 keeps three.
  probs = np.asarray(PROBS[0] ** 0.25 / np.sum(PROBS[0] ** 0.25))
  order = np.argsort(-probs)
  before = np.cumsum(probs[order]) - probs[order]
  want = np.zeros(4, bool)
  want[order[before < 0.7]] = True
  np.testing.assert_array_equal(np.asarray(top_p_mask(LOGITS / 4.0, 0.7)[0]), want)
  assert want.sum() == 3


def test_sample_greedy_and_only_inside_the_nucleus():
  key = jax.random.key(0)
  assert int(sample(LOGITS, key, SamplingConfig())[0]) == 1
  cfg = SamplingConfig(temperature=1.0, top_p=0.7)
  draws = {int(sample(LOGITS, jax.random.fold_in(key, i), cfg)[0]) for i in range(64)}
  assert draws == {1, 3}
  wide = {int(sample(LOGITS, jax.random.fold_in(key, i), SamplingConfig(temperature=1.0))[0])
          for i in range(256)}
  assert wide == {0, 1, 2, 3}


@pytest.mark.parametrize("kw,field", [({"temperature": -1.0}, "sampling.temperature"),
                                      ({"top_p": 0.0}, "sampling.top_p"),
                                      ({"top_k": -2}, "sampling.top_k")])
def test_bad_sampling_config(kw, field):
  with pytest.raises(ConfigError, match=field):
    SamplingConfig(**kw)
