"""A researcher's own balance rules, registered from outside the package.

- ``max_prob_loss``: the mean over tokens of the largest router probability
  (a sharpening penalty; hand-checkable).
- ``tanh`` bias rule: b_i += u tanh(mean c - c_i), a saturating sign rule.
"""

import jax.numpy as jnp

from moejax import balance


@balance.register_loss("max_prob_loss")
def max_prob_loss(result, cfg, *, batch_shape, axis_names):
  return jnp.mean(jnp.max(result.probs, axis=-1))


@balance.register_bias_rule("tanh")
def tanh_rule(load, mean, rate):
  return rate * jnp.tanh(mean - load)
