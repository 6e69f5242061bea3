"""Validation: loss, MaxVio_global and expert specialisation over a split.

Legend: B batch, S sequence length, E FFN experts, E_r routed columns (FFN
plus zero-computation experts), D domains.

:func:`make_eval_step` compiles one forward (``train=False``: no noise, no
controller update) that returns per-batch *sums*; :func:`evaluate` adds them
over the batches on device and reads them back once:

- ``loss``: masked cross-entropy, nats per target token over the pass;
- ``loss_per_byte``: the same total nats divided by the UTF-8 bytes the
  scored targets stand for (the batch's ``target_bytes``; absent, one byte
  per token), so byte-level and subword runs compare; equal to ``loss`` at
  byte level; ``bits_per_byte`` is it over ln 2, and ``bytes`` the count;
- ``max_vio_global``: MaxVio of the load summed over the whole pass
  (a :class:`~moejax.balance.metrics.MaxVioAccumulator` per MoE layer), mean
  over layers, and ``layer_<i>/max_vio_global``;
- ``specialisation_mi`` (nats) and ``specialisation_mi_norm`` (divided by
  H(domain)), mean over layers, and per layer: see
  :mod:`moejax.evaluate.specialization`.

Loads count only scored positions (``mask``), so the padded rows of the last
validation batch do not bias MaxVio_global.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.balance.metrics import MaxVioAccumulator
from moejax.config import ModelConfig
from moejax.evaluate.specialization import joint_counts, mutual_information
from moejax.nn.losses import masked_cross_entropy

Batch = dict[str, Any]


def make_eval_step(graphdef, model_cfg: ModelConfig, num_domains: int) -> Callable:
  """jitted ``eval_step(params, router_state, other, batch) -> sums``.

  sums: ``ce_sum`` f32[], ``count`` f32[], ``bytes`` f32[], and per MoE layer with a routing
  decision ``load/<layer>`` f32[E] and ``joint/<layer>`` f32[E_r, D].
  """
  moe = model_cfg.moe

  def eval_step(params, router_state, other, batch):
    model = nnx.merge(graphdef, params, router_state, other)
    logits, aux = model(batch["inputs"], train=False)
    _, ce_sum, count = masked_cross_entropy(logits, batch["targets"], batch["mask"])
    out = {"ce_sum": ce_sum, "count": count}
    target_bytes = batch.get("target_bytes", batch["mask"])
    out["bytes"] = jnp.sum(jnp.where(batch["mask"], target_bytes, 0).astype(jnp.float32))
    for name, layer in aux["moe"].items():
      if "expert_ids" not in layer:
        continue  # soft / PEER layers have no token -> expert decision
      ids, valid, mask = layer["expert_ids"], layer["valid"], batch["mask"]
      joint = joint_counts(ids, valid, batch["labels"], mask, moe.num_routed, num_domains)
      out[f"joint/{name}"] = joint
      out[f"load/{name}"] = jnp.sum(joint[: moe.topology.num_experts], axis=1)
    return out

  return jax.jit(eval_step)


def evaluate(eval_step: Callable, params, router_state, other, batches: Iterable[Batch],
             num_batches: Optional[int] = None) -> dict[str, float]:
  """Runs ``eval_step`` over ``batches`` (at most ``num_batches``); see the module doc."""
  totals = None
  for i, batch in enumerate(batches):
    if num_batches is not None and i >= num_batches:
      break
    sums = eval_step(params, router_state, other, batch)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  if totals is None:
    raise ValueError("evaluate: the validation split gave no batch; check data.eval_split "
                     "and that the split holds at least one token")
  totals = jax.device_get(totals)
  out: dict[str, float] = {"loss": float(totals["ce_sum"] / max(totals["count"], 1.0)),
                           "tokens": float(totals["count"])}
  out["loss_per_byte"] = float(totals["ce_sum"] / max(totals["bytes"], 1.0))
  out["bits_per_byte"] = out["loss_per_byte"] / float(np.log(2.0))
  out["bytes"] = float(totals["bytes"])
  vio, mi, mi_norm = [], [], []
  for key in sorted(k for k in totals if k.startswith("joint/")):
    name = key.split("/", 1)[1]
    load = totals[f"load/{name}"]
    acc = MaxVioAccumulator.zeros(load.shape[0]).add(jnp.asarray(load))
    v = float(acc.value())
    m, m_norm = mutual_information(totals[key])
    out[f"{name}/max_vio_global"], out[f"{name}/specialisation_mi"] = v, m
    out[f"{name}/specialisation_mi_norm"] = m_norm
    vio.append(v), mi.append(m), mi_norm.append(m_norm)
  if vio:
    out["max_vio_global"] = float(np.mean(vio))
    out["specialisation_mi"] = float(np.mean(mi))
    out["specialisation_mi_norm"] = float(np.mean(mi_norm))
  return out
