"""Base experiments shared by the shipped suites (configs/ablations/*.py).

The survey suites and most reproductions use :func:`small_experiment`: a
2-layer, d=64 decoder whose two FFN slots are MoE layers, byte-level on the
embedded standard-library corpus, sequences of 64, batches of 16, 300 AdamW
steps (307k training tokens). On 2 shared CPU cores one arm trains in about
one to two minutes, so a 4-6 arm suite fits in 5-10 minutes. That is far from
any published scale: the suites test directions and mechanisms, not numbers.
``--config.scale=m|l`` runs any suite wider, deeper and on longer sequences
(:mod:`moejax.ablation.scale`).

Validation curves: the trainer evaluates a fixed subset of
:data:`EVAL_BATCHES` validation batches every ``steps //`` :data:`EVAL_POINTS`
steps (:func:`eval_every`), cheap enough for 15 points per curve; the runner's
final evaluation reads the whole split.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from moejax.ablation.scale import DEFAULT_SCALE
from moejax.config import MoEConfig, from_dict, to_dict

EVAL_POINTS = 15   # periodic evaluations per run (the validation curve's points)
EVAL_BATCHES = 4   # validation batches per periodic evaluation (a fixed subset)


def eval_every(steps: int) -> int:
  """Steps between the periodic evaluations of a ``steps``-step suite run."""
  return max(1, steps // EVAL_POINTS)


SMALL_MOE = dict(
    topology=dict(num_experts=8, expert_width=128, activation="swiglu"),
    routing=dict(kind="topk", top_k=2, score_fn="softmax", gating="normalized"),
    balance=dict(aux_loss_coef=1e-2, aux_loss_scope="batch", aux_loss_convention="topk"),
    execution=dict(backend="blocked"))


def small_moe(**sections: dict) -> dict:
  """SMALL_MOE with some fields of its sections replaced: ``small_moe(routing=dict(top_k=1))``.

  A key absent from SMALL_MOE's sections is added (the layer config checks it).
  """
  tree = copy.deepcopy(SMALL_MOE)
  for name, fields in sections.items():
    if isinstance(fields, dict) and isinstance(tree.get(name), dict):
      tree[name].update(fields)
    else:
      tree[name] = fields
  return tree


def small_experiment(moe: Optional[dict] = None, steps: int = 300, **model) -> dict:
  """The experiment tree of the small suite model (``moe`` replaces SMALL_MOE)."""
  model_tree = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, dense_ff_width=256,
                    moe=copy.deepcopy(SMALL_MOE) if moe is None else moe)
  model_tree.update(model)
  return dict(
      model=model_tree,
      data=dict(name="python_stdlib", seq_len=64, batch_size=16, seed=0),
      train=dict(steps=steps, learning_rate=3e-3, warmup_steps=20, min_lr_ratio=0.1,
                 weight_decay=0.1, grad_clip=1.0, log_every=25, eval_every=eval_every(steps),
                 eval_batches=EVAL_BATCHES, checkpoint_every=steps // 3, keep_checkpoints=4,
                 progress=True))


def moe_config(tree: dict[str, Any]) -> MoEConfig:
  return from_dict(MoEConfig, tree)


def moe_dict(cfg: MoEConfig) -> dict:
  """A MoEConfig as the nested dict an arm override takes (tuples as lists kept)."""
  return to_dict(cfg)


def suite_config(**fields):
  """The suite tree as an ``ml_collections.ConfigDict``, so ``--config.base.train.steps=50``
  style overrides work from the command line."""
  import ml_collections  # pylint: disable=g-import-not-at-top

  fields.setdefault("scale", DEFAULT_SCALE)  # --config.scale=m (moejax.ablation.scale)

  def convert(v):  # nested dicts too: ConfigDict would otherwise sort the arms by name
    if isinstance(v, dict):
      return ml_collections.ConfigDict({k: convert(x) for k, x in v.items()}, sort_keys=False)
    return v

  return convert(fields)
