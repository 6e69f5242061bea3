"""A researcher's own router, registered from outside the package: X-MoE's cosine router.

Chi et al. 2022 (arXiv 2204.09179) route on the cosine similarity between a
low-dimensional projection of the token and learned expert embeddings,
divided by a temperature: s_e(x) = cos(W x, e_e) / tau. Projecting to a small
dimension before the similarity is their fix for representation collapse.

Legend: T tokens, d model width, r projection width, E_r router outputs.

Nothing under ``moejax/`` knows this file. It registers two kinds:

- ``cosine``: options ``proj_dim`` (r) and ``temperature`` (tau), parameters
  ``proj`` [d, r] and ``experts`` [r, E_r] (not one d x E matrix);
- ``cosine_scaled``: the same plus a learned logit scale whose parameter its
  ``param_shapes`` forgets to declare: the accounting cannot know it, and
  the budget audit must refuse any suite that trains it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moejax import routing
from moejax.config import check_count, check_positive
from moejax.routing.topk import select_topk


@dataclasses.dataclass(frozen=True)
class CosineOptions:
  """proj_dim: r, the width of the similarity space; temperature: tau."""

  proj_dim: int = 8
  temperature: float = 0.07

  def __post_init__(self):
    check_count("moe.routing.options.proj_dim", self.proj_dim)
    check_positive("moe.routing.options.temperature", self.temperature)


def _unit(v: jax.Array, axis: int) -> jax.Array:
  return v * jax.lax.rsqrt(jnp.sum(v * v, axis=axis, keepdims=True) + 1e-6)


class Cosine(routing.RouterSpec):
  """Token-choice top-k on cosine similarities (selection bias supported)."""

  name = "cosine"
  Options = CosineOptions
  supports_bias = True

  def param_shapes(self, d_model, cfg):
    r = cfg.routing.opts.proj_dim
    return {"proj": (d_model, r), "experts": (r, cfg.num_routed)}

  def logits(self, params, x, cfg, rng, train):
    rc = cfg.routing
    h = _unit(jnp.einsum("td,dr->tr", x, params["proj"].astype(x.dtype)), axis=-1)  # [T, r]
    e = _unit(params["experts"].astype(x.dtype), axis=0)  # [r, E_r]
    logits = jnp.einsum("tr,re->te", h, e) / rc.opts.temperature
    if train and rc.logit_noise > 0:
      logits = logits + rc.logit_noise * jax.random.normal(rng, logits.shape, logits.dtype)
    return logits

  def route(self, params, x, bias, cfg, *, token_ids, rng, train):
    return select_topk(self.logits(params, x, cfg, rng, train), bias, cfg)


class CosineScaled(Cosine):
  """Cosine with a learned logit scale that ``param_shapes`` does not declare (a bug)."""

  name = "cosine_scaled"

  def init_params(self, key, d_model, cfg):
    params = super().init_params(key, d_model, cfg)
    params["scale"] = jnp.ones((cfg.num_routed,), jnp.float32)  # not in param_shapes
    return params

  def route(self, params, x, bias, cfg, *, token_ids, rng, train):
    logits = self.logits(params, x, cfg, rng, train) * params["scale"].astype(x.dtype)
    return select_topk(logits, bias, cfg)


routing.register(Cosine())
routing.register(CosineScaled())
