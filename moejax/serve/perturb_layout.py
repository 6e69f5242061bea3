"""Perturbations of how a forward is laid out: cached decoding, micro-batches, expert parallelism.

Legend: B sequences, S tokens per sequence.

- ``decode``: KV-cached decoding, the first token as the prompt, then one
  token per step (n/a for routers that are not causal, e.g. expert choice).
- ``microbatch4``: the batch in 4 row chunks, one forward each (batch-wide
  routers and capacity see a quarter of the batch).
- ``ep1`` / ``ep2`` / ``ep8``: every MoE layer run by
  :func:`moejax.layer.ep_moe_layer` on a sub-mesh of the first 1 / 2 / 8
  devices (``parallel.expert`` = the degree, the batch rows split over it).
  On CPU the devices are simulated: ``JAX_NUM_CPU_DEVICES=8`` must be set
  before JAX starts, else ep2 / ep8 say so as n/a.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flax import nnx

from moejax.config import ConfigError, ParallelConfig
from moejax.config.parallel import check_experts
from moejax.execution import mesh as mesh_lib
from moejax.nn.moe_block import ExpertParallel
from moejax.routing.replay import RoutingReplay
from moejax.serve import decode as decode_lib
from moejax.serve import perturbation as P


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


def _decodable(model, tokens) -> str:
  del tokens
  try:
    decode_lib.check_decodable(model.cfg)
  except ConfigError as err:
    return str(err)
  return ""


def _microbatch(model, tokens, parts: int = 4):
  tokens = np.asarray(tokens, np.int32)
  chunks = [P.reference_selections(model, c) for c in np.array_split(tokens, parts)]
  return {n: RoutingReplay(jnp.concatenate([c[n].expert_ids for c in chunks]),
                           jnp.concatenate([c[n].valid for c in chunks])) for n in chunks[0]}


def _splits_in(parts: int):
  def why_not(model, tokens):
    del model
    b = np.asarray(tokens).shape[0]
    return "" if b >= parts else f"the batch has {b} rows, fewer than {parts} micro-batches"
  return why_not


def _pcfg(degree: int) -> ParallelConfig:
  return ParallelConfig(data=1, expert=degree)


def _expert_parallel(degree: int):
  def run(model, tokens):
    pcfg = _pcfg(degree)
    mesh = mesh_lib.make_mesh(pcfg, jax.devices()[:degree], cfg=model.cfg.moe)
    ep_model = P.rebuilt(model, {}, expert_parallel=ExpertParallel(mesh, pcfg))
    # Every leaf replicated on the sub-mesh: jit reshards the experts to the layer's specs.
    nnx.update(ep_model, jax.device_put(nnx.state(model), NamedSharding(mesh, PartitionSpec())))
    return P.reference_selections(ep_model, tokens)
  return run


def _ep_applies(degree: int):
  def why_not(model, tokens):
    n = jax.device_count()
    if n < degree:
      return (f"needs {degree} devices, {n} visible (on CPU set JAX_NUM_CPU_DEVICES=8 "
              "before JAX starts)")
    try:
      check_experts(_pcfg(degree), model.cfg.moe)
    except ConfigError as err:
      return str(err)
    b = np.asarray(tokens).shape[0]
    if b % degree:
      return f"the batch has {b} rows, which do not split over {degree} devices"
    return ""
  return why_not


P.register(P.Perturbation("decode", _decode, _decodable,
                          description="KV-cached decoding, one token per step"))
P.register(P.Perturbation("microbatch4", _microbatch, _splits_in(4),
                          description="the batch in 4 row chunks, one forward each"))
for _degree in (1, 2, 8):
  P.register(P.Perturbation(f"ep{_degree}", _expert_parallel(_degree), _ep_applies(_degree),
                            description=f"ep_moe_layer on {_degree} device(s)",
                            devices=_degree))
