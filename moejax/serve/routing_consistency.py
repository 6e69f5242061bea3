"""A model's routing under numerical perturbations, against its reference forward.

It lives with serving, not in ``moejax.evaluate``: cached decoding is one of
the perturbations, and serving builds on training, which evaluation feeds.

Legend: B sequences, S tokens per sequence.

Each perturbation is a registered :class:`Perturbation`: a name, whether it
applies to a model (``why_not``), and ``selections(model, tokens)``, the
per-layer selections of the perturbed forward on the same tokens. The
reference is the model's own full forward (float32 as configured).
:func:`measure` compares each with :func:`moejax.evaluate.consistency.compare`.

Shipped here:

- ``bf16``: the model rebuilt with ``model.compute_dtype='bfloat16'``, the
  same weights;
- ``decode``: KV-cached decoding, the first token as the prompt, then one
  token per step (n/a for non-causal routers, e.g. expert choice);
- ``microbatch4``: the batch in 4 row chunks, one forward each (batch-wide
  routers and capacity see a quarter of the batch).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import ConfigError, apply_overrides
from moejax.evaluate import consistency as consistency_lib
from moejax.routing.replay import RoutingReplay
from moejax.serve import decode as decode_lib


def _selections(model, tokens) -> dict[str, RoutingReplay]:
  aux = model(jnp.asarray(tokens, jnp.int32))[1]
  return {n: layer["selection"] for n, layer in aux["moe"].items() if "selection" in layer}


def _rebuilt(model, **overrides):
  """``model`` with config ``overrides`` and the same state (an abstract rebuild, no init)."""
  cfg = apply_overrides(model.cfg, overrides)
  new = nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0)))
  nnx.update(new, nnx.state(model))
  return new


def _bf16(model, tokens):
  return _selections(_rebuilt(model, compute_dtype="bfloat16"), tokens)


def _decode(model, tokens):
  tokens = np.asarray(tokens, np.int32)
  b, s = tokens.shape
  dec = decode_lib.Decoder(model)
  caches = dec.init_caches(b, s)
  seen = []
  for t in range(s):
    _, caches, info = dec.extend(tokens[:, t:t + 1], np.full((b, 1), t, np.int32),
                                 np.ones((b, 1), bool), caches, t)
    seen.append(info["routing"])
  return {n: RoutingReplay(jnp.concatenate([c[n]["expert_ids"] for c in seen], axis=1),
                           jnp.concatenate([c[n]["valid"] for c in seen], axis=1))
          for n in seen[0]}


def _decode_why_not(model) -> str:
  try:
    decode_lib.check_decodable(model.cfg)
  except ConfigError as err:
    return str(err)
  return ""


def _microbatch(model, tokens, parts: int = 4):
  tokens = np.asarray(tokens, np.int32)
  chunks = [_selections(model, c) for c in np.array_split(tokens, parts)]
  return {n: RoutingReplay(jnp.concatenate([c[n].expert_ids for c in chunks]),
                           jnp.concatenate([c[n].valid for c in chunks])) for n in chunks[0]}


@dataclasses.dataclass(frozen=True)
class Perturbation:
  """A perturbed forward: ``selections(model, tokens)``; ``why_not(model)`` '' when it applies."""

  name: str
  selections: Callable
  why_not: Callable = lambda model: ""


PERTURBATIONS: dict[str, Perturbation] = {}


def register(p: Perturbation) -> Perturbation:
  if p.name in PERTURBATIONS:
    raise ValueError(f"perturbation {p.name!r} is registered twice")
  PERTURBATIONS[p.name] = p
  return p


register(Perturbation("bf16", _bf16))
register(Perturbation("decode", _decode, _decode_why_not))
register(Perturbation("microbatch4", _microbatch))


def measure(model, tokens, names: Optional[tuple[str, ...]] = None) -> dict:
  """``{name: {'flip_rate', 'token_flip_share', 'layer_flip_rate'} or {'n/a': why}}``."""
  names = tuple(PERTURBATIONS) if names is None else tuple(names)
  unknown = [n for n in names if n not in PERTURBATIONS]
  if unknown:
    raise ValueError(f"routing consistency: unknown perturbations {unknown}. Fix: use some "
                     f"of {sorted(PERTURBATIONS)}")
  if model.cfg.moe is None:
    raise ValueError("routing consistency: the model has no MoE layer. Fix: measure a MoE model")
  reference = _selections(model, tokens)
  out = {}
  for name in names:
    p = PERTURBATIONS[name]
    why = p.why_not(model)
    if why:
      out[name] = {"n/a": why}
      continue
    got = consistency_lib.compare(reference, p.selections(model, tokens),
                                  model.cfg.moe.num_routed)
    out[name] = dataclasses.asdict(got)
  return out
