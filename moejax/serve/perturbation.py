"""A perturbed forward of a model, as a registered object, and the selections it reads.

Legend: B sequences, S tokens per sequence, E_r router outputs.

A :class:`Perturbation` is one way a forward of the same model on the same
tokens can differ numerically from the reference (bf16 compute, quantised
experts, expert parallelism, ...). It carries its name, whether it applies
(``why_not(model, tokens)``: '' when it does, else the reason, e.g. decoding
a router that is not causal) and ``selections(model, tokens)``: the
perturbed forward's per-layer selections. A perturbation that makes its own
reference in the same computation (the forward that remat recomputes
against the original) sets ``own_reference`` and returns both.

The reference forward is :func:`reference_selections`: the model jitted as
it is configured, ``train=False``. Every perturbation runs jitted too, so
no flip comes from jit against eager execution.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.config import apply_overrides
from moejax.routing.replay import RoutingReplay
from moejax.serve import quantize as quant_lib


def selections_of(aux: dict) -> dict[str, RoutingReplay]:
  """``{'layer_<i>': RoutingReplay [B, S, K]}`` of a model forward's aux."""
  return {n: layer["selection"] for n, layer in aux["moe"].items() if "selection" in layer}


def reference_selections(model, tokens) -> dict[str, RoutingReplay]:
  """The selections of ``model``'s own jitted forward (``train=False``)."""
  return selections_of(quant_lib.forward(model, jnp.asarray(np.asarray(tokens), jnp.int32))[1])


def rebuilt(model, overrides: dict, **kwargs):
  """``model`` with config ``overrides`` (and constructor ``kwargs``), the same state.

  An abstract rebuild (no init): the new model's variables are ``model``'s.
  """
  cfg = apply_overrides(model.cfg, overrides) if overrides else model.cfg
  new = nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0), **kwargs))
  nnx.update(new, nnx.state(model))
  return new


def applies(model, tokens) -> str:
  """The default ``why_not``: every model."""
  del model, tokens
  return ""


@dataclasses.dataclass(frozen=True)
class Perturbation:
  """A perturbed forward; see the module doc.

  Attributes:
    name: the key of its row in a measurement.
    selections: ``(model, tokens) -> {layer: RoutingReplay}`` of the perturbed
      forward, or ``(reference, perturbed)`` when ``own_reference``.
    why_not: ``(model, tokens) -> str``: '' when it applies, else why not.
    own_reference: ``selections`` returns its own reference forward's
      selections first (made in the same computation).
    description: one line for docs and reports.
    devices: how many devices the perturbed forward needs; where this process
      sees fewer on CPU, a suite measures it in a child process that simulates
      them (:mod:`moejax.serve.consistency_child`).
  """

  name: str
  selections: Callable
  why_not: Callable = applies
  own_reference: bool = False
  description: str = ""
  devices: int = 1


PERTURBATIONS: dict[str, Perturbation] = {}


def register(p: Perturbation) -> Perturbation:
  if p.name in PERTURBATIONS:
    raise ValueError(f"perturbation {p.name!r} is registered twice")
  PERTURBATIONS[p.name] = p
  return p
