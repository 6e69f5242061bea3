"""Post-training measurements of one arm: routing, communication, latency, causal leakage.

Legend: B batch, S sequence length, T = B*S tokens, K slots per token, E FFN
experts, E_r routed columns (FFN + zero-computation), D domains, P
expert-parallel devices.

Everything here reads a finished run's checkpoints (never trains):

- :func:`routing_pass`: over validation batches, per MoE layer, the load
  f32[E_r], the (expert, domain) counts f32[E_r, D] and the co-activation
  counts f32[E_r, E_r] (tokens that chose both experts); run on every kept
  checkpoint it gives per-expert load over training.
- :func:`a2a_bytes`: all-to-all bytes per token that expert parallelism over P
  devices would move for the *realised* routing: tokens sharded over the
  devices in order, experts placed contiguously (expert e on device
  floor(e P / E): E/P per device when P divides E), a copy sent
  for each slot on a remote device (the per-copy all_to_all convention of
  :mod:`moejax.execution.comm`), dispatch + combine, forward only.
- :func:`moe_latency`: P50 / P99 wall time of one jitted MoE layer forward at
  the run's token count. Measured on whatever CPU runs the suite: on a shared
  machine the tails are noise as much as signal, so compare arms within one
  suite run only.
- :func:`causal_probe`: the loss at positions p computed from the prefix
  x[:p+1] alone versus the teacher-forced loss at the same positions. For a
  causal model they are equal; a router that selects over the whole chunk
  (expert choice) can use future tokens in the teacher-forced pass, and the
  relative gap measures that leak (Wang et al. 2408.15664, Sec. 5.2).
- :func:`routing_consistency`: the flip rates of the final checkpoint's
  routing under numerical perturbations and its near-tie margins
  (:mod:`moejax.serve.consistency_report`).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax import data as data_lib
from moejax.evaluate import latency as latency_lib
from moejax.train import checkpoint as ckpt_lib
from moejax.train import load as load_lib
from moejax.train.config import ExperimentConfig


def load_model(cfg: ExperimentConfig, workdir: str, step: Optional[int] = None):
  """(nnx model, step) restored from the run's checkpoint (the latest by default).

  The checkpoint restore of :func:`moejax.load` (``moejax.train.load``), with
  the suite's config for this run.
  """
  if not ckpt_lib.checkpoint_steps(workdir):
    raise FileNotFoundError(f"{workdir} has no checkpoint to analyse")
  return load_lib.model_at(cfg, workdir, step)


def val_batches(cfg: ExperimentConfig, num: int):
  docs = data_lib.load_documents(cfg.data, cfg.data.eval_split)
  it = data_lib.make_batch_iterator(docs, cfg.data.seq_len, cfg.data.batch_size,
                                    seed=cfg.data.seed, train=False)
  out = []
  for i, batch in enumerate(it):
    if i >= num:
      break
    out.append(batch)
  return out, list(docs.domain_names)


@functools.partial(jax.jit, static_argnums=0)
def _routing_forward(graphdef, state, inputs):
  """(logits, {layer: (expert_ids, valid)}); graphdef static, so checkpoints share one compile."""
  logits, aux = nnx.merge(graphdef, state)(inputs, train=False)
  routing = {name: (layer["expert_ids"], layer["valid"])
             for name, layer in aux["moe"].items() if "expert_ids" in layer}
  return logits, routing


def _make_forward(model):
  graphdef, state = nnx.split(model)
  return lambda inputs: _routing_forward(graphdef, state, inputs)


def routing_pass(model, cfg: ExperimentConfig, batches, num_domains: int) -> dict:
  """Per layer ``{"load": [E_r], "joint": [E_r][D], "coact": [E_r][E_r]}`` plus ``ids``.

  ``ids`` keeps each layer's ``(expert_ids int[T, K], sent bool[T, K])`` of the
  pass for the communication accounting (not serialised).
  """
  fwd = _make_forward(model)
  out: dict = {}
  for batch in batches:
    _, routing = fwd(batch["inputs"])
    add_routing(out, routing, batch, cfg, num_domains)
  return out


def add_routing(out: dict, routing: dict, batch, cfg: ExperimentConfig,
                num_domains: int) -> None:
  """Adds one batch's ``{layer: (expert_ids, valid)}`` to :func:`routing_pass`'s accumulators."""
  e_r = cfg.model.moe.num_routed
  mask = np.asarray(batch["mask"], bool)
  labels = np.asarray(batch["labels"])
  for name, (ids, valid) in routing.items():
    ids, valid = np.asarray(ids), np.asarray(valid, bool) & mask[..., None]
    hot = np.zeros(ids.shape[:2] + (e_r,), np.float64)                  # [B, S, E_r]
    for k in range(ids.shape[-1]):
      b_idx, s_idx = np.nonzero(valid[..., k])
      np.add.at(hot, (b_idx, s_idx, ids[b_idx, s_idx, k]), 1.0)
    flat = hot.reshape(-1, e_r)
    lab = np.eye(num_domains)[labels.reshape(-1)] * mask.reshape(-1, 1)  # [T, D]
    acc = out.setdefault(name, {"load": np.zeros(e_r), "joint": np.zeros((e_r, num_domains)),
                                "coact": np.zeros((e_r, e_r)), "ids": []})
    acc["load"] += flat.sum(0)
    acc["joint"] += flat.T @ lab
    acc["coact"] += flat.T @ (flat > 0)
    acc["ids"].append((ids.reshape(-1, ids.shape[-1]),
                       (valid & (ids < cfg.model.moe.num_experts)).reshape(-1, ids.shape[-1])))


def a2a_bytes(ids_per_batch, num_experts: int, devices: int, row_bytes: int) -> dict:
  """All-to-all bytes per token (dispatch + combine) for P devices; see the module doc.

  Args:
    ids_per_batch: [(expert_ids int[T, K], sent bool[T, K])] of one layer.
  Returns ``copies`` (what a per-copy all_to_all sends) and ``min_device``
  (each token once per distinct remote device), bytes per token.
  """
  copies = dedup = 0.0
  tokens = 0
  for ids, sent in ids_per_batch:
    t = ids.shape[0]
    src = (np.arange(t) * devices) // t                                 # [T]
    dest = (ids * devices) // num_experts                                # [T, K]
    remote = sent & (dest != src[:, None])
    copies += remote.sum()
    hot = np.zeros((t, devices), bool)
    rows = np.nonzero(remote)
    hot[rows[0], dest[rows]] = True
    dedup += hot.sum()
    tokens += t
  scale = 2.0 * row_bytes / max(tokens, 1)
  return {"copies": copies * scale, "min_device": dedup * scale}


def ep_devices(num_experts: int, wanted: int) -> int:
  """P = min(wanted, E): experts are placed contiguously, floor(e P / E) (uneven when P does
  not divide E, e.g. DeepSeekMoE's 31 routed experts over 8 devices)."""
  return max(1, min(wanted, num_experts))


def moe_latency(cfg: ExperimentConfig, reps: int = 30, warmup: int = 3) -> dict:
  """P50 / P99 ms of one jitted MoE layer forward on T = batch x seq_len tokens.

  The measurement is :func:`moejax.evaluate.latency.layer_latency` at the
  suite's own batch shape.
  """
  row, = latency_lib.layer_latency(cfg.model.moe, cfg.model.d_model,
                                   batch_sizes=(cfg.data.batch_size,),
                                   seq_len=cfg.data.seq_len, iters=reps, warmup=warmup)
  return {"moe_latency_p50_ms": row["p50_ms"], "moe_latency_p99_ms": row["p99_ms"],
          "moe_latency_tokens": row["tokens"]}


def causal_probe(model, batches, positions: Sequence[int]) -> dict:
  """Teacher-forced vs prefix-only loss at ``positions``; see the module doc."""
  graphdef, state = nnx.split(model)
  logits_of = lambda state, inputs: _routing_forward(graphdef, state, inputs)[0]

  def ce(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

  tf_sum = pre_sum = count = 0.0
  for batch in batches:
    inputs, targets = batch["inputs"], batch["targets"]
    mask = np.asarray(batch["mask"], bool)
    full = np.asarray(ce(logits_of(state, inputs), targets))            # [B, S]
    for p in positions:
      prefix = np.asarray(ce(logits_of(state, inputs[:, :p + 1]), targets[:, :p + 1]))[:, p]
      m = mask[:, p]
      tf_sum += float(full[:, p][m].sum())
      pre_sum += float(prefix[m].sum())
      count += float(m.sum())
  tf, pre = tf_sum / max(count, 1), pre_sum / max(count, 1)
  return {"probe_teacher_forced_loss": tf, "probe_prefix_loss": pre,
          "probe_leak_gap": (pre - tf) / pre if pre else 0.0,
          "probe_positions": list(positions), "probe_tokens": count}


# Validation batches of the routing sample the consistency measurement reads (the first ones):
# decoding and the Hugging Face round trip run eagerly per token or in torch.
CONSISTENCY_BATCHES = 4


def routing_consistency(model, batches, names: Sequence[str]) -> dict:
  """``flip_rate_<name>`` / ``token_flip_share_<name>`` per perturbation that applies, the
  margins' median and small share, and ``consistency_na``: why the others did not run."""
  from moejax.serve import consistency_report  # pylint: disable=g-import-not-at-top
  report = consistency_report.evaluate(model, [b["inputs"] for b in batches], names)
  out = consistency_report.columns(report)
  out["consistency_na"] = {n: r["n/a"] for n, r in report.perturbations.items() if "n/a" in r}
  out["consistency_tokens"] = report.tokens
  return out
