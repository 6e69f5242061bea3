"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus).

Legend: B batch, V vocabulary.

The order is the one of Hugging Face ``generate`` and vLLM: logits divided
by the temperature, then the top-k filter, then the top-p filter, then one
categorical draw. ``temperature == 0`` is greedy (argmax; the filters do not
change the argmax). Nucleus sampling (Holtzman et al. 1904.09751) keeps the
smallest set of most likely tokens whose probability sums to at least p;
the most likely token is always kept.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature: 0 = greedy. top_k: 0 = no top-k filter. top_p: 1.0 = no nucleus filter."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ConfigError("sampling.temperature", self.temperature, "must be >= 0",
                        "use 0 for greedy decoding or a positive temperature such as 0.8")
    if self.top_k < 0:
      raise ConfigError("sampling.top_k", self.top_k, "must be >= 0",
                        "use 0 (no filter) or the number of tokens to keep")
    if not 0.0 < self.top_p <= 1.0:
      raise ConfigError("sampling.top_p", self.top_p, "must be in (0, 1]",
                        "use 1.0 (no filter) or a nucleus mass such as 0.9")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
  """bool[B, V]: the k largest logits of each row (ties at the k-th value all kept)."""
  if k <= 0 or k >= logits.shape[-1]:
    return jnp.ones(logits.shape, bool)
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return logits >= kth


def top_p_mask(logits: jax.Array, p: float) -> jax.Array:
  """bool[B, V]: the nucleus, the fewest most likely tokens with probability mass >= p.

  A token is kept iff the mass of the tokens strictly more likely than it
  (in sorted order) is < p, so the most likely token is always kept.
  """
  if p >= 1.0:
    return jnp.ones(logits.shape, bool)
  order = jnp.argsort(-logits, axis=-1)
  probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ahead, sorted order
  keep_sorted = before < p
  inverse = jnp.argsort(order, axis=-1)
  return jnp.take_along_axis(keep_sorted, inverse, axis=-1)


def filtered_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """logits / temperature with tokens outside top-k and top-p set to -inf."""
  x = logits.astype(jnp.float32) / (cfg.temperature if cfg.temperature > 0 else 1.0)
  keep = top_k_mask(x, cfg.top_k) & top_p_mask(x, cfg.top_p)
  return jnp.where(keep, x, -jnp.inf)


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """int32[B] next tokens from logits f32[B, V]."""
  if cfg.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits, cfg), axis=-1).astype(jnp.int32)
