"""A model's routing under numerical perturbations, against its reference forward.

It lives with serving, not in ``moejax.evaluate``: cached decoding and
quantised experts are perturbations, and serving builds on training, which
evaluation feeds.

Legend: B sequences, S tokens per sequence, K slots per token.

Each perturbation is a registered
:class:`~moejax.serve.perturbation.Perturbation`: a name, whether it
applies to a model and tokens (``why_not``), and ``selections(model,
tokens)``, the per-layer selections of the perturbed forward on the same
tokens. The reference is the model's own jitted forward (as configured,
``train=False``), except for a perturbation that makes its own
(``own_reference``). :func:`measure` compares each with
:func:`moejax.evaluate.consistency.compare`.

Shipped (in registration order):

- :mod:`moejax.serve.perturb_numeric`: ``bf16``, ``int8``, ``int4``, ``remat``;
- :mod:`moejax.serve.perturb_layout`: ``decode``, ``microbatch4``, ``ep1``,
  ``ep2``, ``ep8``;
- ``hf``: the round trip through ``transformers`` of a model Mixtral
  expresses (:mod:`moejax.interop.routing_roundtrip`).

:func:`measure` runs them in name order by default.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from moejax.evaluate import consistency as consistency_lib
from moejax.interop import routing_roundtrip
from moejax.serve import perturb_layout  # noqa: F401  (registers its perturbations)
from moejax.serve import perturb_numeric  # noqa: F401  (registers its perturbations)
from moejax.serve.perturbation import (PERTURBATIONS, Perturbation, reference_selections,
                                       register)

register(Perturbation("hf", lambda model, tokens: routing_roundtrip.selections(model, tokens),
                      lambda model, tokens: routing_roundtrip.why_not(model),
                      description="exported to transformers' Mixtral and run there"))


def check_names(names) -> tuple[str, ...]:
  """``names`` as a tuple, or ValueError naming the unknown ones and the registered."""
  names = tuple(names)
  unknown = [n for n in names if n not in PERTURBATIONS]
  if unknown:
    raise ValueError(f"routing consistency: unknown perturbations {unknown}. Fix: use some "
                     f"of {list(PERTURBATIONS)}")
  return names


def measure(model, tokens, names: Optional[tuple[str, ...]] = None) -> dict:
  """``{name: {'flip_rate', 'token_flip_share', 'layer_flip_rate'} or {'n/a': why}}``."""
  names = tuple(sorted(PERTURBATIONS)) if names is None else check_names(names)
  if model.cfg.moe is None:
    raise ValueError("routing consistency: the model has no MoE layer. Fix: measure a MoE model")
  tokens = np.asarray(tokens, np.int32)
  reference = None
  out = {}
  for name in names:
    p = PERTURBATIONS[name]
    why = p.why_not(model, tokens)
    if why:
      out[name] = {"n/a": why}
      continue
    if p.own_reference:
      ref, other = p.selections(model, tokens)
    else:
      if reference is None:
        reference = reference_selections(model, tokens)
      ref, other = reference, p.selections(model, tokens)
    got = consistency_lib.compare(ref, other, model.cfg.moe.num_routed)
    out[name] = dataclasses.asdict(got)
  return out


__all__ = ["PERTURBATIONS", "Perturbation", "check_names", "measure", "register"]
