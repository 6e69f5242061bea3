"""Validation: loss, MaxVio_global and expert specialisation over a split.

Legend: B batch, S sequence length, E FFN experts, E_r routed columns (FFN
plus zero-computation experts), D domains, N documents of the split.

:func:`make_eval_step` compiles one forward (``train=False``: no noise, no
controller update) that returns per-batch *sums*; :func:`evaluate_totals`
adds them over the batches on device and reads them back once, and
:func:`summarise` turns the totals into the metrics (:func:`evaluate` does
both):

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

Loads and specialisation count every non-padding position (the batch's
``valid``; ``mask`` when it has none), so the padded rows of the last
validation batch do not bias MaxVio_global. The loss scores the ``mask``
positions: with ``data.loss_domains`` only the targets of those domains.

Per domain (every non-padding target, whatever ``data.loss_domains``
scores): ``domain_ce`` / ``domain_count`` f32[D] sums, and
``loss_domain/<name>`` in the summary when the domain names are given:
what fine-tuning reads as target-domain loss and forgetting.

Per document (``make_eval_step(..., num_docs=N)``, for the final whole-split
evaluation of an ablation run): the cross-entropy sum and the target count
of every document, f32[N] each, summed over the batch's ``doc_ids`` (see
:mod:`moejax.data.packing`; a separator target counts for the document it
opens). They add up to the split's totals, so the split's loss is
sum(doc_ce) / sum(doc_count), and a paired bootstrap over documents can
resample them (:mod:`moejax.ablation.stats`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from moejax.balance.metrics import MaxVioAccumulator
from moejax.config import ModelConfig
from moejax.evaluate.specialization import joint_counts, mutual_information
from moejax.nn.losses import masked_cross_entropy

Batch = dict[str, Any]


def make_eval_step(graphdef, model_cfg: ModelConfig, num_domains: int,
                   num_docs: Optional[int] = None, with_routing: bool = False) -> Callable:
  """jitted ``eval_step(params, router_state, other, batch) -> sums``.

  sums: ``ce_sum`` f32[], ``count`` f32[], ``bytes`` f32[], ``domain_ce`` and
  ``domain_count`` f32[D] (every valid target, by its label), and per MoE layer
  with a routing decision ``load/<layer>`` f32[E] and ``joint/<layer>``
  f32[E_r, D]; with ``num_docs`` N also ``doc_ce`` and ``doc_count`` f32[N]
  (the batch must carry ``doc_ids``).

  ``with_routing``: return ``(sums, routing)`` with ``routing`` =
  ``{layer: (expert_ids int[B, S, K], valid bool[B, S, K])}`` of the same
  forward, for analyses that need each token's experts (co-activation,
  all-to-all volume) without a second pass over the split.
  """
  moe = model_cfg.moe

  def eval_step(params, router_state, other, batch):
    model = nnx.merge(graphdef, params, router_state, other)
    logits, aux = model(batch["inputs"], train=False)
    _, ce_sum, count = masked_cross_entropy(logits, batch["targets"], batch["mask"])
    out = {"ce_sum": ce_sum, "count": count}
    target_bytes = batch.get("target_bytes", batch["mask"])
    out["bytes"] = jnp.sum(jnp.where(batch["mask"], target_bytes, 0).astype(jnp.float32))
    seen = batch.get("valid", batch["mask"])   # every non-padding target
    # The same per-position CE as masked_cross_entropy, on every valid target.
    ce_all = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]) * seen                # [B, S]
    labels = jnp.where(seen, batch["labels"], -1).reshape(-1)  # -1: dropped by segment_sum
    out["domain_ce"] = jax.ops.segment_sum(ce_all.reshape(-1), labels, num_segments=num_domains)
    out["domain_count"] = jax.ops.segment_sum(seen.reshape(-1).astype(jnp.float32), labels,
                                              num_segments=num_domains)
    if num_docs is not None:
      # Summed per document over the scored targets; ids of padding are -1,
      # which segment_sum drops.
      m = batch["mask"].astype(jnp.float32)
      ce = ce_all * m
      ids = jnp.where(batch["mask"], batch["doc_ids"], -1).reshape(-1)
      out["doc_ce"] = jax.ops.segment_sum(ce.reshape(-1), ids, num_segments=num_docs)
      out["doc_count"] = jax.ops.segment_sum(m.reshape(-1), ids, num_segments=num_docs)
    for name, layer in aux["moe"].items():
      if "expert_ids" not in layer:
        continue  # soft / PEER layers have no token -> expert decision
      ids, valid, mask = layer["expert_ids"], layer["valid"], seen
      joint = joint_counts(ids, valid, batch["labels"], mask, moe.num_routed, num_domains)
      out[f"joint/{name}"] = joint
      out[f"load/{name}"] = jnp.sum(joint[: moe.topology.num_experts], axis=1)
    if with_routing:
      return out, {name: (layer["expert_ids"], layer["valid"])
                   for name, layer in aux["moe"].items() if "expert_ids" in layer}
    return out

  return jax.jit(eval_step)


def evaluate(eval_step: Callable, params, router_state, other, batches: Iterable[Batch],
             num_batches: Optional[int] = None,
             domain_names: Optional[Sequence[str]] = None) -> dict[str, float]:
  """Runs ``eval_step`` over ``batches`` (at most ``num_batches``); see the module doc."""
  return summarise(evaluate_totals(eval_step, params, router_state, other, batches, num_batches),
                   domain_names)


def evaluate_totals(eval_step: Callable, params, router_state, other, batches: Iterable[Batch],
                    num_batches: Optional[int] = None) -> dict[str, np.ndarray]:
  """The sums of ``eval_step`` over ``batches`` (at most ``num_batches``), as numpy arrays."""
  totals = None
  for i, batch in enumerate(batches):
    if num_batches is not None and i >= num_batches:
      break
    sums = eval_step(params, router_state, other, batch)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  if totals is None:
    raise ValueError("evaluate: the validation split gave no batch; check data.eval_split "
                     "and that the split holds at least one token")
  return {k: np.asarray(v) for k, v in jax.device_get(totals).items()}


def summarise(totals: dict, domain_names: Optional[Sequence[str]] = None) -> dict[str, float]:
  """The metrics of the module doc from :func:`evaluate_totals`' sums.

  ``domain_names``: adds ``loss_domain/<name>`` for every domain with a valid target.
  """
  out: dict[str, float] = {"loss": float(totals["ce_sum"] / max(totals["count"], 1.0)),
                           "tokens": float(totals["count"])}
  out["loss_per_byte"] = float(totals["ce_sum"] / max(totals["bytes"], 1.0))
  out["bits_per_byte"] = out["loss_per_byte"] / float(np.log(2.0))
  out["bytes"] = float(totals["bytes"])
  if domain_names is not None and "domain_ce" in totals:
    for name, ce, n in zip(domain_names, totals["domain_ce"], totals["domain_count"]):
      if n > 0:
        out[f"loss_domain/{name}"] = float(ce / n)
  joints = {k.split("/", 1)[1]: v for k, v in totals.items() if k.startswith("joint/")}
  loads = {k.split("/", 1)[1]: v for k, v in totals.items() if k.startswith("load/")}
  out.update(routing_metrics(joints, loads))
  return out


def routing_metrics(joints: dict, loads: Optional[dict] = None) -> dict[str, float]:
  """Per layer and mean over layers: MaxVio_global (of ``loads``) and I(expert; domain).

  The one place these numbers are computed from the (expert, domain) counts
  ``joints`` {layer: f[E_r, D]} and the loads {layer: f[E]}: the training
  loop's evaluation, the ablation summary and the routing notebook all call
  it, so their numbers agree.
  """
  out: dict[str, float] = {}
  vio, mi, mi_norm = [], [], []
  for name in sorted(joints):
    m, m_norm = mutual_information(joints[name])
    out[f"{name}/specialisation_mi"], out[f"{name}/specialisation_mi_norm"] = m, m_norm
    mi.append(m), mi_norm.append(m_norm)
    if loads is not None and name in loads:
      load = np.asarray(loads[name])
      v = float(MaxVioAccumulator.zeros(load.shape[0]).add(jnp.asarray(load)).value())
      out[f"{name}/max_vio_global"] = v
      vio.append(v)
  if vio:
    out["max_vio_global"] = float(np.mean(vio))
  if mi:
    out["specialisation_mi"] = float(np.mean(mi))
    out["specialisation_mi_norm"] = float(np.mean(mi_norm))
  return out
