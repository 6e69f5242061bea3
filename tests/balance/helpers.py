"""Hand-built RoutingResults for balance tests (no router involved)."""

import jax.numpy as jnp
import numpy as np

from moejax.routing.types import RoutingResult


def make_result(ids, probs, valid=None, weights=None, logits=None) -> RoutingResult:
  """A RoutingResult from nested lists; invalid slots get id 0 and weight 0."""
  ids = np.asarray(ids, np.int32)
  probs = np.asarray(probs, np.float32)
  valid = np.ones(ids.shape, bool) if valid is None else np.asarray(valid, bool)
  weights = (np.full(ids.shape, 1.0 / ids.shape[1], np.float32) if weights is None
             else np.asarray(weights, np.float32))
  if logits is None:
    logits = np.log(np.maximum(probs, 1e-30))
  return RoutingResult(expert_ids=jnp.asarray(np.where(valid, ids, 0)),
                       weights=jnp.asarray(np.where(valid, weights, 0.0)),
                       valid=jnp.asarray(valid), probs=jnp.asarray(probs),
                       logits=jnp.asarray(logits, jnp.float32))


def uniform_probs(t: int, e: int) -> np.ndarray:
  return np.full((t, e), 1.0 / e, np.float32)
