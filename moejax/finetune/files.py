"""Fine-tuning config files (``configs/finetune.py``) and the options compared side by side.

A fine-tuning config file has no ``model`` section (an upcycling one has
only its MoE fields, :data:`UPCYCLE_MODEL`): the model is the source's (``experiments.finetune --source=DIR`` reads it from the run's
config.json or the Hugging Face config). :func:`finetune_config_dict` lists
every field of the other sections, defaults included, so a misspelt
``--config.finetune.lora_rnak`` is an error; the ``finetune`` options are
validated once the source (and so the model) is known.

:data:`OPTIONS` are the standard fine-tuning options
``experiments.finetune --accounting`` prints side by side.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from moejax.config import ModelConfig, MoEConfig, ParallelConfig, from_dict, to_dict
from moejax.config.finetune import present_components
from moejax.data import DataConfig, vocab_size
from moejax.train.config import ExperimentConfig, TrainConfig, _to_config_dict_tree

SECTIONS = ("data", "train", "parallel", "finetune", "model")
# The model fields an upcycling config file gives (the rest is the dense source's).
UPCYCLE_MODEL = ("moe", "moe_layout", "first_dense_layers")

# name -> finetune fields (rank: the run's lora_rank, or 8)
OPTIONS = {
    "full": {},
    "router frozen": {"freeze": ("router",)},
    "experts frozen": {"freeze": ("experts",)},
    "LoRA attention+dense": {"freeze": ("all",), "lora": ("attention", "dense")},
    "LoRA experts": {"freeze": ("all",), "lora": ("experts",)},
    "LoRA experts, router trains": {"freeze": ("all",), "lora": ("experts",),
                                    "train_router": True},
}


def finetune_config_dict(**sections: Mapping[str, Any]):
  """An ``ml_collections.ConfigDict`` of a fine-tuning config file (see the module doc)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    raise ValueError(f"finetune_config_dict: unknown sections {sorted(unknown)} (the model is "
                     f"the source's); use {', '.join(SECTIONS)}")
  data = from_dict(DataConfig, sections.get("data", {}), "data")
  cfg = ExperimentConfig(model=ModelConfig(vocab_size=vocab_size(data)), data=data,
                         train=from_dict(TrainConfig, sections.get("train", {}), "train"),
                         parallel=from_dict(ParallelConfig, sections.get("parallel", {}),
                                            "parallel"))
  tree = _to_config_dict_tree(cfg)
  model = dict(sections.get("model") or {})
  bad = sorted(set(model) - set(UPCYCLE_MODEL))
  if bad:
    raise ValueError(f"finetune_config_dict: model.{bad[0]} is the source's; an upcycling "
                     f"config gives only {', '.join(UPCYCLE_MODEL)}")
  if model:   # every MoE field listed, so that --config.model.moe.routing.top_k=1 works
    moe = from_dict(MoEConfig, model.get("moe") or {}, "model.moe")
    full = {k: v for k, v in tree["model"].items() if k in UPCYCLE_MODEL}
    full.update({k: v for k, v in model.items() if k != "moe"}, moe=_to_config_dict_tree(moe))
    tree["model"] = full
  else:
    del tree["model"]
  ft = tree["finetune"]
  for key, value in dict(sections.get("finetune", {})).items():
    if key not in ft:
      raise ValueError(f"finetune.{key} is not a finetune field; fields: {sorted(ft)}")
    ft[key] = value
  return ml_collections.ConfigDict(tree)


def option_configs(cfg: ExperimentConfig) -> dict[str, ExperimentConfig]:
  """``{option: the run with that option}`` for the :data:`OPTIONS` the model admits, plus the
  run itself (``this run``)."""
  rank = cfg.finetune.lora_rank or 8
  present = present_components(cfg.model)
  base_model = cfg.model
  if base_model.moe is not None and base_model.moe.routing.freeze:  # undo the resolution
    moe = dataclasses.replace(base_model.moe, routing=dataclasses.replace(
        base_model.moe.routing, freeze=False))
    base_model = dataclasses.replace(base_model, moe=moe)
  out = {}
  for name, fields in OPTIONS.items():
    fields = dict(fields)
    train_router = fields.pop("train_router", False)
    lora = tuple(c for c in fields.get("lora", ()) if c in present)
    if "lora" in fields:
      if not lora:
        continue
      fields.update(lora=lora, lora_rank=rank)
    if train_router:
      if "router" not in present:
        continue
      fields["freeze"] = tuple(c for c in present - {"router"})
    if any(c not in present and c != "all" for c in fields.get("freeze", ())):
      continue
    ft = {"source": cfg.finetune.source, "source_format": cfg.finetune.source_format, **fields}
    tree = to_dict(cfg)
    tree["model"], tree["finetune"] = to_dict(base_model), ft
    out[name] = _build(tree)
  out["this run"] = cfg
  return out


def _build(tree) -> ExperimentConfig:
  from moejax.train.config import experiment_from_dict  # pylint: disable=g-import-not-at-top
  return experiment_from_dict(tree)


__all__ = ["OPTIONS", "SECTIONS", "finetune_config_dict", "option_configs"]
