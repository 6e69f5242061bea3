"""Router logits with Switch-style training noise.

Legend: T tokens, d model width, E_r router outputs (FFN plus zero-computation
experts).

Two regularisers, both active only when ``train=True``:

- input jitter (Switch Transformer, Fedus et al. 2101.03961): the router
  input is multiplied elementwise by u ~ Uniform[1-eps, 1+eps]. Only the
  router sees the jittered input; the experts get the clean x.
- logit noise (Shazeer et al. 1701.06538 noisy top-k, simplified to a fixed
  std): logits += std * N(0, 1).

Both need an explicit PRNG key; a missing key in training is an error, never
a silent no-op.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from moejax.config import RoutingConfig
from moejax.routing.scores import router_dtype


def needs_rng(cfg: RoutingConfig, train: bool) -> bool:
  return train and (cfg.input_jitter > 0 or cfg.logit_noise > 0)


def check_rng(cfg: RoutingConfig, rng: Optional[jax.Array], train: bool) -> None:
  if needs_rng(cfg, train) and rng is None:
    names = [f"moe.routing.{n}={getattr(cfg, n)}" for n in ("input_jitter", "logit_noise")
             if getattr(cfg, n) > 0]
    raise ValueError(f"{' and '.join(names)} draw random noise in training but rng=None. "
                     "Fix: pass rng=<PRNG key> to route(), or set them to 0, or train=False.")


def jitter_input(x: jax.Array, cfg: RoutingConfig, rng: Optional[jax.Array],
                 train: bool) -> jax.Array:
  """x[T, d] cast to the router dtype, times Uniform[1-eps, 1+eps] in training."""
  x = x.astype(router_dtype(cfg))
  if not (train and cfg.input_jitter > 0):
    return x
  eps = cfg.input_jitter
  u = jax.random.uniform(rng, x.shape, x.dtype, 1.0 - eps, 1.0 + eps)
  return x * u


def router_logits(w: jax.Array, x: jax.Array, cfg: RoutingConfig,
                  rng: Optional[jax.Array], train: bool) -> jax.Array:
  """f[T, E_r] = x[T, d] @ w[d, E_r] in the router dtype, plus noise in training."""
  dt = router_dtype(cfg)
  logits = jnp.einsum("td,de->te", x.astype(dt), w.astype(dt), preferred_element_type=dt)
  if train and cfg.logit_noise > 0:
    logits = logits + cfg.logit_noise * jax.random.normal(rng, logits.shape, dt)
  return logits
