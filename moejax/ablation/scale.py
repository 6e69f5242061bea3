"""The scale ladder: one transformation of an experiment tree, applied to every arm of a suite.

``--config.scale=s|m|l`` on any suite (``suite.scale``; default ``s``).
A rung multiplies five groups of integer fields of a complete experiment
tree (``{model, data, train, parallel}``, every default present) by its
factors, and leaves every other field alone:

- ``width`` w: every hidden width, ``model.d_model``, the dense FFN width,
  the routed, per-expert and shared expert widths, an explicit head width,
  multi-head latent attention's latent ranks and head widths, and the PEER
  query width (:data:`WIDTH_FIELDS`). Head counts stay, so the head width
  grows w-fold. A field the model's layer kind does not read (its
  ``honoured`` fields; PEER's singleton experts have no expert width) or
  its attention kind does not have is left alone;
- ``depth`` L: ``model.n_layers`` and ``model.first_dense_layers``
  (:data:`DEPTH_FIELDS`): an ``every_other`` stack keeps its pattern, a
  ``first_dense`` stack its dense share;
- ``seq`` / ``batch``: ``data.seq_len`` and ``data.batch_size``;
- ``steps`` t: ``train.steps`` and every step count that is a position in
  the run (warmup, log / eval / checkpoint cadence, the bias controller's
  freeze step; :data:`STEP_FIELDS`), so the schedule has the same shape.

Counts (experts, top-k, granularity, shared experts, zero-computation
experts, heads, slots, groups, PEER keys) and every real number (learning
rate, balance coefficients, bias rate, capacity factor, fractions) are not
scaled (:data:`UNSCALED`), so an arm keeps its relation to the suite's
other arms at every rung: a fine-grained arm (``topology.granularity=m``)
is segmented from its scaled coarse layer, and arms with equal total /
active parameters keep them equal (the router, d x E, grows as w while the
experts grow as w^2, so the router-driven differences of ``granularity``
and ``deepseekmoe`` shrink with scale). Integer factors keep every
divisibility the configs check (heads, granularity, devices, micro-batches).
The learning rate is not rescaled: every rung trains with the suite's
optimizer settings (a learning-rate sweep per rung would multiply the
suites' compute).

Rungs (:data:`SCALES`; sizes of the small suite model in docs/ablations.md,
printed by ``--budget_only``):

- ``s``: the identity, today's suites;
- ``m``: w 2, L 2, seq 2 (d=128, 4 layers, sequences of 128 on the small
  suite model: 3.5M parameters, ~15x the training compute of ``s``, 2x
  the tokens);
- ``l``: w 3, L 2, seq 2, batch 2 (d=192, 4 layers, sequences of 128, batches
  of 32: 7.5M parameters, ~4x the compute of ``m``, 2x its tokens).

Steps stay at 1 on the shipped rungs: the bias controller's reach
(rate x steps), the warmup and the evaluation cadence then mean the same
thing at every rung, and more tokens come from longer and wider batches,
which a CPU also runs at a better rate than more small steps.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping

from moejax.config import ConfigError
from moejax.config.registry import LAYERS


@dataclasses.dataclass(frozen=True)
class Scale:
  """A rung: integer factors of widths, depth, sequence length, batch size and steps."""

  name: str
  width: int = 1
  depth: int = 1
  seq: int = 1
  batch: int = 1
  steps: int = 1

  def factors(self) -> dict[str, int]:
    return {g: getattr(self, g) for g in GROUPS}

  def describe(self) -> str:
    """``width x2, depth x2, seq x2`` (``identity`` for s)."""
    parts = [f"{g} x{f}" for g, f in self.factors().items() if f != 1]
    return ", ".join(parts) if parts else "identity"


SCALES = {
    "s": Scale("s"),
    "m": Scale("m", width=2, depth=2, seq=2),
    "l": Scale("l", width=3, depth=2, seq=2, batch=2),
}
DEFAULT_SCALE = "s"

# The dotted fields each factor multiplies: the one list of config paths this
# module depends on (update it when a field moves).
WIDTH_FIELDS = ("model.d_model", "model.dense_ff_width", "model.head_dim",
                "model.moe.topology.expert_width", "model.moe.topology.expert_widths",
                "model.moe.topology.shared_expert_width", "model.moe.layer_options.key_dim",
                "model.attention_options.q_lora_rank", "model.attention_options.kv_lora_rank",
                "model.attention_options.qk_nope_head_dim",
                "model.attention_options.qk_rope_head_dim", "model.attention_options.v_head_dim")
DEPTH_FIELDS = ("model.n_layers", "model.first_dense_layers")
SEQ_FIELDS = ("data.seq_len",)
BATCH_FIELDS = ("data.batch_size",)
STEP_FIELDS = ("train.steps", "train.warmup_steps", "train.log_every", "train.eval_every",
               "train.checkpoint_every", "model.moe.balance.bias_freeze_step")
FIELDS = {"width": WIDTH_FIELDS, "depth": DEPTH_FIELDS, "seq": SEQ_FIELDS,
          "batch": BATCH_FIELDS, "steps": STEP_FIELDS}
GROUPS = tuple(FIELDS)

# Integer fields deliberately left alone (tests/ablation/test_scale.py checks
# that every integer field of the experiment config is in FIELDS or here). A
# router's own options (``model.moe.routing.options.*``: families, seeds, a
# plugin's fields) belong to the router and are never scaled.
UNSCALED = {
    "model.vocab_size": "the tokenizer's",
    "model.n_heads": "head count: the head width grows instead",
    "model.n_kv_heads": "head count",
    "model.expert_sharing_group": "a pattern of consecutive MoE layers",
    "model.mod_every": "a pattern of blocks",
    "model.mtp_depth": "count of multi-token prediction modules",
    "model.moe.topology.num_experts": "expert counts are the arms' axes",
    "model.moe.topology.num_shared_experts": "count",
    "model.moe.topology.zero_experts": "count",
    "model.moe.execution.large_group_rows": "the backend rule's threshold, measured per "
                                            "machine (moejax.execution.shape_choice)",
    "model.moe.topology.copy_experts": "count",
    "model.moe.topology.constant_experts": "count",
    "model.moe.layer_options.slots_per_expert": "count",
    "model.moe.layer_options.num_keys": "count",
    "model.moe.layer_options.heads": "count",
    "model.moe.layer_options.top_k": "count",
    "model.moe.topology.granularity": "an arm's axis (applied to the scaled width)",
    "model.moe.topology.isolate_shared": "count",
    "model.moe.routing.top_k": "count",
    "model.moe.routing.n_groups": "count",
    "model.moe.routing.topk_groups": "count",
    "model.moe.balance.loss_num_devices": "devices",
    "data.seed": "a seed",
    "data.bpe_vocab_size": "the tokenizer's",
    "data.stdlib_max_files": "the corpus is the same at every rung",
    "data.synthetic_train_docs": "the corpus",
    "data.synthetic_val_docs": "the corpus",
    "data.synthetic_min_doc_bytes": "the corpus",
    "data.synthetic_max_doc_bytes": "the corpus",
    "data.synthetic_seed": "the corpus",
    "train.seed": "a seed",
    "train.keep_checkpoints": "how many files, not when",
    "train.eval_batches": "batches per periodic evaluation (each grows with seq and batch)",
    "train.nan_at_step": "a test hook at an absolute step",
    "train.microbatches": "count (divides the batch at every rung)",
    "finetune.lora_rank": "an adapter's rank is a fine-tuning arm's axis",
    "finetune.source_step": "a checkpoint step of the source (steps do not scale)",
    "finetune.upcycle.split": "how many experts one dense FFN is cut into: the upcycling's axis",
}


def get_scale(name: Any) -> Scale:
  """The rung named ``name``; ConfigError naming ``suite.scale`` otherwise."""
  if not isinstance(name, str) or name not in SCALES:
    raise ConfigError("suite.scale", name, "is not a rung of the scale ladder",
                      f"use one of {', '.join(SCALES)} (--config.scale=m)")
  return SCALES[name]


def _multiply(value: Any, factor: int, path: str) -> Any:
  if value is None or factor == 1:
    return value
  if isinstance(value, (list, tuple)):  # per-expert widths
    return type(value)(_multiply(v, factor, path) for v in value)
  if isinstance(value, bool) or not isinstance(value, int):
    raise ConfigError(path, value, "is not an integer, so the scale ladder cannot multiply it",
                      "give an integer")
  return value * factor if value > 0 else value  # 0 = off, -1 = never


def _get(tree: Mapping[str, Any], path: str) -> Any:
  node: Any = tree
  for key in path.split("."):
    node = node.get(key) if isinstance(node, Mapping) else None
  return node


def _read_by_the_layer_kind(tree: Mapping[str, Any], path: str) -> bool:
  """False for a ``model.moe.<section>.<field>`` the tree's layer kind does not honour
  (scaling it would set a field the kind refuses); True for every other path. A kind's
  own options (``layer_options``) and an attention kind's are in the tree only when
  the kind has them."""
  parts = path.split(".")
  kind_name = _get(tree, "model.moe.kind")
  if parts[:2] != ["model", "moe"] or len(parts) != 4 or kind_name is None:
    return True
  honoured = LAYERS.get(kind_name).honoured.get(parts[2])
  return honoured is None or parts[3] in honoured


def scale_experiment(tree: Mapping[str, Any], scale: Scale | str) -> dict:
  """A copy of the experiment ``tree`` at rung ``scale`` (a :class:`Scale` or its name).

  ``tree`` is a nested dict of an experiment (e.g. ``to_dict`` of an
  ExperimentConfig, or a suite arm after its overrides); paths absent from it
  (a dense model has no ``model.moe``) are skipped. ``s`` returns an equal copy.
  """
  scale = get_scale(scale) if isinstance(scale, str) else scale
  out = copy.deepcopy(dict(tree))
  for group, paths in FIELDS.items():
    factor = getattr(scale, group)
    for path in paths:
      if not _read_by_the_layer_kind(out, path):
        continue
      parent, leaf = path.rsplit(".", 1)
      node = _get(out, parent)
      if isinstance(node, dict) and leaf in node:
        node[leaf] = _multiply(node[leaf], factor, path)
  return out
