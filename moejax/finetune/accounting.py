"""What a fine-tuning option costs: trainable parameters, optimizer state, activation memory.

Legend: B batch rows, S sequence length, T = B S / microbatches tokens per
forward, d model width, N / M query / key-value heads, H head width, F dense
width, E routed experts, E_r router outputs, K experts per token, f expert
width, F_s shared width, V vocabulary, r LoRA rank, c bytes of the compute
dtype.

:func:`accounting` of one experiment (printed by the trainer before a
fine-tuning run trains, and by ``experiments.finetune --accounting`` for
every option side by side):

- ``params``: every parameter, adapters included; ``trainable``: those the
  optimizer updates (:func:`moejax.train.optim.frozen_components`);
- ``weight_bytes``: float32 parameters; ``grad_bytes``: float32 gradients of
  the trainable ones (frozen weights get no gradient);
- ``optimizer_bytes``: the bytes of the optimizer state, exact: the arrays
  ``tx.init`` builds (``jax.eval_shape``; AdamW keeps two float32 moments per
  trainable parameter, frozen ones have none);
- ``activation_bytes``: an *estimate* of the activations the backward pass
  keeps for one micro-batch, counted tensor by tensor below. It is not
  XLA's buffer assignment (fusion and rematerialisation change the real
  peak), but it moves with the options the way the real one does.

Per block, the saved tensors (in c bytes unless said):

- attention: its input and normalised input (2 d), q, k, v
  (N H + 2 M H), the attention output (N H), per token; the attention
  probabilities B N S^2 (float32);
- FFN: its input and normalised input (2 d); dense: gate, up and their
  product (3 F; 2 F for GELU); MoE: router logits and probabilities
  (2 E_r, float32), the permuted token copies and their outputs (2 K d),
  gate, up and product per copy (3 K f), the shared expert as a dense FFN
  of width F_s;
- LoRA: each adapted projection keeps x A (r per token); expert LoRA keeps
  the merged expert weights of the layer (E (3 d f) for SwiGLU), the price
  of running adapted experts through the unchanged grouped matmul.

A sub-layer's tensors are kept only when a trainable parameter sits at or
below it (otherwise no gradient passes through it); the head keeps the
logits and their softmax (2 V, float32) per token when anything trains.
With ``model.remat`` a block keeps only its input (d per token) and one
block's tensors are live at a time.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax

from moejax.config.finetune import ADAPTERS, component
from moejax.train.config import ExperimentConfig
from moejax.train.optim import frozen_components

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Accounting:
  params: int
  trainable: int
  weight_bytes: int
  grad_bytes: int
  optimizer_bytes: int
  activation_bytes: float
  by_component: dict   # {component: (params, trainable)}

  @property
  def total_bytes(self) -> float:
    return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out["total_bytes"] = self.total_bytes
    return out


def _key(k) -> str:
  return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def accounting(cfg: ExperimentConfig, abstract_params, tx) -> Accounting:
  """The accounting of ``cfg`` with its params' shapes and optimizer (see the module doc)."""
  frozen = frozen_components(cfg.model, cfg.finetune)
  flat, _ = jax.tree_util.tree_flatten_with_path(abstract_params)
  by: dict = {}
  for path, leaf in flat:
    comp = component([_key(k) for k in path])
    n = int(leaf.size)
    total, train = by.get(comp, (0, 0))
    by[comp] = (total + n, train + (0 if comp in frozen else n))
  params = sum(v[0] for v in by.values())
  trainable = sum(v[1] for v in by.values())
  opt = jax.eval_shape(tx.init, abstract_params)
  opt_bytes = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(opt)
                  if hasattr(x, "dtype"))
  trainable_comps = {c for c, (_, t) in by.items() if t}
  return Accounting(params=params, trainable=trainable, weight_bytes=4 * params,
                    grad_bytes=4 * trainable, optimizer_bytes=opt_bytes,
                    activation_bytes=activation_bytes(cfg, trainable_comps), by_component=by)


def activation_bytes(cfg: ExperimentConfig, trainable: set) -> float:
  """The activation estimate of the module doc, for the set of trainable components."""
  m = cfg.model
  if not trainable:
    return 0.0
  c = _DTYPE_BYTES.get(m.compute_dtype, 4)
  b = cfg.data.batch_size // cfg.train.microbatches
  s = cfg.data.seq_len
  t = b * s
  d, h = m.d_model, m.attn_head_dim
  lora, r = set(cfg.finetune.lora), cfg.finetune.lora_rank
  adapted = lambda comp: ADAPTERS in trainable and comp in lora
  norms = "norms" in trainable
  below = "embeddings" in trainable   # a trainable parameter at or below this point
  per_block = []
  for i in range(m.n_layers):
    attn = t * c * (2 * d + 2 * m.n_heads * h + 2 * m.kv_heads * h) + 4.0 * b * m.n_heads * s * s
    if "attention" in lora:
      attn += 4 * t * c * r
    below = below or norms or "attention" in trainable or adapted("attention")
    kept = attn if below else 0.0
    if m.is_moe_layer(i):
      shared = m.moe.topology.num_shared_experts > 0
      here = bool({"router", "experts"} & trainable) or adapted("experts") or (
          shared and ("dense" in trainable or adapted("dense")))
      ffn = _moe_bytes(m, t, c, lora, r)
    else:
      here = "dense" in trainable or adapted("dense")
      mats = 3 if m.dense_activation == "swiglu" else 2
      ffn = t * c * (2 * d + mats * m.dense_ff_width)
      if "dense" in lora:
        ffn += mats * t * c * r
    below = below or norms or here
    per_block.append(kept + (ffn if below else 0.0))
  head = 2 * 4.0 * t * m.vocab_size
  if m.remat:
    return float(m.n_layers * t * c * d + max(per_block, default=0.0) + head)
  return float(sum(per_block) + head)


def _moe_bytes(m, t: int, c: int, lora: set, r: int) -> float:
  moe = m.moe
  d = m.d_model
  if not moe.layer.routed:
    # Soft MoE / PEER: their dispatch tensors are counted as the routed experts
    # of a top-1 layer (a rough stand-in; the options table compares options).
    k, e_r = 1, moe.num_experts
  else:
    k, e_r = moe.routing.top_k, moe.num_routed
  top = moe.topology
  f = max(top.expert_widths) if top.expert_widths else top.expert_width
  mats = 3 if top.activation == "swiglu" else 2
  out = t * c * 2 * d + 2 * 4.0 * t * e_r + t * k * c * (2 * d + mats * f)
  if top.num_shared_experts:
    from moejax.topology.experts import shared_width  # pylint: disable=g-import-not-at-top
    fs = top.num_shared_experts * shared_width(moe)
    out += t * c * mats * fs
    if "dense" in lora:
      out += mats * t * c * r
  if "experts" in lora and moe.layer.expert_bank:
    out += c * moe.num_experts * mats * d * f   # the merged expert weights
  return out


def human_bytes(n: Optional[float]) -> str:
  if n is None:
    return "n/a"
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def table(rows: dict) -> str:
  """Aligned text table of ``{option: Accounting}`` (the trainer prints one row)."""
  head = ["option", "params", "trainable", "weights", "grads", "optimizer", "activations*",
          "total"]
  lines = [head]
  for name, a in rows.items():
    share = f"{a.trainable:,} ({100 * a.trainable / max(a.params, 1):.1f}%)"
    lines.append([name, f"{a.params:,}", share, human_bytes(a.weight_bytes),
                  human_bytes(a.grad_bytes), human_bytes(a.optimizer_bytes),
                  human_bytes(a.activation_bytes), human_bytes(a.total_bytes)])
  widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
  out = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
         for r in lines]
  out.insert(1, "-" * len(out[0]))
  out.append("* activations: an estimate of what the backward pass keeps for one micro-batch "
             "(moejax.finetune.accounting); optimizer bytes are exact")
  return "\n".join(out)


@dataclasses.dataclass(frozen=True)
class Compute:
  """Training tokens and FLOPs (3 x forward FLOPs/token x tokens, the backward ~ 2 forwards)."""

  tokens: int
  flops: float


def run_compute(exp: ExperimentConfig, steps: Optional[int] = None) -> Compute:
  """The compute of ``exp``'s own training (to ``steps``, default ``train.steps``)."""
  from moejax.topology.accounting import budget  # pylint: disable=g-import-not-at-top
  steps = exp.train.steps if steps is None else steps
  tokens = steps * exp.data.batch_size * exp.data.seq_len
  return Compute(tokens, 3.0 * float(budget(exp.model, exp.data.seq_len).flops_per_token) *
                 tokens)


def source_compute(exp: ExperimentConfig, source: Optional[ExperimentConfig] = None,
                   depth: int = 8) -> Optional[Compute]:
  """The compute that made ``exp``'s source: its training (to ``finetune.source_step``) plus,
  recursively, its own source's. ``source``: the source's config when it is not on disk yet
  (a suite's source run); else read from the moejax run directory. None for a run from scratch
  and for a source whose training is unknown (a Hugging Face model)."""
  ft = exp.finetune
  if not ft.enabled or depth <= 0:
    return None
  if source is None:
    from moejax.finetune.source import detect_format  # pylint: disable=g-import-not-at-top
    from moejax.train import load as load_lib  # pylint: disable=g-import-not-at-top
    path = os.path.expanduser(ft.source)
    if ft.source_format == "hf" or not os.path.isdir(path) or detect_format(path) != "moejax":
      return None
    from moejax.train.checkpoint import WorkdirError  # pylint: disable=g-import-not-at-top
    try:
      source = load_lib.run_config(path)
    except WorkdirError:  # no readable config.json: its compute is unknown
      return None
  own = run_compute(source, ft.source_step if ft.source_step >= 0 else None)
  before = source_compute(source, None, depth - 1)
  if before is None:
    return own
  return Compute(own.tokens + before.tokens, own.flops + before.flops)


def compute_line(exp: ExperimentConfig) -> str:
  """The compute of a fine-tuning run with its source's, in words (the trainer prints it)."""
  from moejax.topology.accounting import human  # pylint: disable=g-import-not-at-top
  own, src = run_compute(exp), source_compute(exp)
  if src is None:
    return (f"compute: this run {human(own.tokens)} tokens, {human(own.flops)} FLOPs; the "
            "source's training is unknown (not a moejax run)")
  return (f"compute: source {human(src.tokens)} tokens, {human(src.flops)} FLOPs + this run "
          f"{human(own.tokens)} tokens, {human(own.flops)} FLOPs = {human(src.tokens + own.tokens)}"
          f" tokens, {human(src.flops + own.flops)} FLOPs in all")
