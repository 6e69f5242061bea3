"""Shared helpers for the routing tests.

Legend: T tokens, d model width, E routed experts, K slots per token.
"""

import hypothesis
import jax.numpy as jnp
import numpy as np

from moejax.config import MoEConfig, RoutingConfig
from tests.configs import moe_config

# JAX property tests: few examples, no per-example deadline (first calls compile).
PROPS = hypothesis.settings(max_examples=25, deadline=None)


def make_cfg(num_experts=4, zero_experts=0, copy_experts=0, **router) -> MoEConfig:
  return moe_config(num_experts=num_experts, zero_experts=zero_experts,
                   copy_experts=copy_experts, routing=RoutingConfig.build(**router))


def log_rows(rows) -> jnp.ndarray:
  """Logits whose softmax is exactly the given probability rows."""
  return jnp.log(jnp.asarray(rows, jnp.float32))


def logit_rows(rows) -> jnp.ndarray:
  """Logits whose sigmoid is the given score rows: log(s / (1 - s))."""
  s = np.asarray(rows, np.float64)
  return jnp.asarray(np.log(s / (1 - s)), jnp.float32)


def random_logits(seed: int, t: int, e: int, scale: float = 2.0) -> jnp.ndarray:
  return jnp.asarray(np.random.default_rng(seed).normal(0, scale, (t, e)), jnp.float32)


def identity_route_inputs(logits):
  """(x, w) with x @ w == logits: x is the T x T identity, w the logits."""
  t = logits.shape[0]
  return jnp.eye(t, dtype=jnp.float32), jnp.asarray(logits, jnp.float32)
