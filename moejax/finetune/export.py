"""A fine-tuned run back to the Hugging Face layout: merged LoRA, or adapters kept apart.

Legend: d model width, f expert width, r LoRA rank, E experts.

::

    export_run("/tmp/ft", "/tmp/ft_hf")                     # merged: a plain Mixtral checkpoint
    export_run("/tmp/ft", "/tmp/ft_hf", lora="separate")    # base + PEFT-style adapters

writes ``config.json`` and ``model.safetensors`` (transformers loads them
with ``MixtralForCausalLM.from_pretrained``) through
:func:`moejax.interop.models.export_model`, so the model must be one the
family expresses (every layer MoE, softmax top-k routing without a
selection bias, untied head: a run of configs/default_mixtral.py, not of
configs/default.py; otherwise, before anything is written, one
InteropError line names each field the family lacks and the fix).

``lora='merge'`` folds every adapter into its weight (W + (alpha / r) A B,
:func:`moejax.nn.lora.merge_tree`). ``lora='separate'`` writes the base
weights unchanged and the adapters to ``adapter_model.safetensors`` with an
``adapter_config.json``, in PEFT's naming (torch weights are [out, in], so
``lora_A.weight`` = A^T [r, in] and ``lora_B.weight`` = B^T [out, r]; the
merged weight is W + (alpha / r) lora_B @ lora_A):

- attention: ``base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight``;
- routed experts, per expert, under the released checkpoints' expert names
  (Mixtral ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` for gate /
  up / down): ``...experts.{e}.w1.lora_A.weight`` [r, d] and so on. PEFT has
  no standard for expert adapters (transformers >= 5 fuses the experts), so
  these are what PEFT would name adapters on the per-expert Linear modules
  of the released layout.

``moejax_export.json`` records the run, its checkpoint step and the mode.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np
from flax import nnx

from moejax.interop import families as fam
from moejax.interop import models as hf_models
from moejax.interop.errors import InteropError
from moejax.interop.tensors import save_safetensors
from moejax.nn import lora as lora_lib

LORA_MODES = ("merge", "separate")
_PEFT = "base_model.model."
# moejax expert matrix -> (index of the family's expert_keys, transpose of [in, out] per expert)
_EXPERT_KEY = {"w_gate": 0, "w_up": 1, "w_down": 2}


def _t(a) -> np.ndarray:
  return np.ascontiguousarray(np.swapaxes(np.asarray(a, np.float32), -1, -2))


def peft_adapters(params: dict, model_type: str = "mixtral") -> tuple[dict, list[str]]:
  """(adapter tensors under PEFT names, target module names) of a params tree's adapters."""
  family = fam.get_family(model_type)
  sd, targets = {}, set()
  for i, block in params.get("blocks", {}).items():
    prefix = f"{_PEFT}model.layers.{i}."
    for name, lin in block.get("attn", {}).items():
      lora = lin.get("lora") if isinstance(lin, dict) else None
      if lora and name not in hf_models.ATTENTION:
        # Latent attention's projections have other HF names and DeepSeek-V3 interleaves
        # their rotary rows: adapters under these names would load nowhere, or wrongly.
        raise InteropError(f"lora='separate': layer {i}'s attention adapter on {name!r} has no "
                           f"PEFT name in {model_type} (adapters are written for q / k / v / "
                           "o projections only). Fix: export with lora='merge'")
      if lora:
        sd[f"{prefix}self_attn.{name}.lora_A.weight"] = _t(lora["lora_a"])
        sd[f"{prefix}self_attn.{name}.lora_B.weight"] = _t(lora["lora_b"])
        targets.add(name)
    adapters = block.get("ffn", {}).get("adapters") or {}
    if set(adapters) - {"experts"}:
      raise InteropError(f"adapters on {sorted(set(adapters) - {'experts'})} of layer {i}: "
                         f"{model_type} has no shared expert. Fix: export with lora='merge'")
    block_prefix = f"{_PEFT}{family.checkpoint_prefix.format(layer=i)}."
    for mat, ab in adapters.get("experts", {}).items():
      hf_name = family.expert_keys[_EXPERT_KEY[mat]]
      a, b = _t(ab["a"]), _t(ab["b"])          # [E, r, in], [E, out, r]
      for e in range(a.shape[0]):
        sd[f"{block_prefix}experts.{e}.{hf_name}.lora_A.weight"] = np.ascontiguousarray(a[e])
        sd[f"{block_prefix}experts.{e}.{hf_name}.lora_B.weight"] = np.ascontiguousarray(b[e])
      targets.add(hf_name)
  return sd, sorted(targets)


def export_params(params: dict, router_state: Optional[dict], cfg, out_dir: str, *,
                  model_type: str = "mixtral", lora: str = "merge", lora_rank: int = 0,
                  lora_alpha: Optional[float] = None, layout: str = "checkpoint",
                  note: Optional[dict] = None) -> dict:
  """Writes a (possibly adapted) model's pure-dict params as an HF checkpoint directory.

  ``cfg``: the ModelConfig; ``lora_rank`` / ``lora_alpha``: the adapters'
  (scale alpha / r). Returns ``{what: path}`` of the files written.
  """
  if lora not in LORA_MODES:
    raise InteropError(f"lora={lora!r}: use one of {', '.join(LORA_MODES)}")
  scale = 0.0 if not lora_rank else (1.0 if lora_alpha is None else lora_alpha / lora_rank)
  base, adapters = lora_lib.split_tree(params)
  has_adapters = bool(adapters)
  if has_adapters and lora == "merge":
    base = lora_lib.merge_tree(params, scale)
  exported = hf_models.export_model(base, router_state, cfg, model_type, layout=layout)
  os.makedirs(out_dir, exist_ok=True)
  written = {"config": os.path.join(out_dir, "config.json"),
             "weights": os.path.join(out_dir, "model.safetensors")}
  save_safetensors(exported.state_dict, written["weights"])
  with open(written["config"], "w", encoding="utf-8") as f:
    json.dump(exported.hf_config, f, indent=2, sort_keys=True)
  if has_adapters and lora == "separate":
    sd, targets = peft_adapters(params, model_type)
    written["adapters"] = os.path.join(out_dir, "adapter_model.safetensors")
    written["adapter_config"] = os.path.join(out_dir, "adapter_config.json")
    save_safetensors(sd, written["adapters"])
    with open(written["adapter_config"], "w", encoding="utf-8") as f:
      json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_rank,
                 "lora_alpha": lora_rank if lora_alpha is None else lora_alpha,
                 "lora_dropout": 0.0, "bias": "none", "target_modules": targets,
                 "base_model_name_or_path": os.path.abspath(out_dir)}, f, indent=2,
                sort_keys=True)
  written["note"] = os.path.join(out_dir, "moejax_export.json")
  with open(written["note"], "w", encoding="utf-8") as f:
    json.dump({"model_type": model_type, "lora": lora if has_adapters else "none",
               "lora_rank": lora_rank, "lora_alpha": lora_alpha, **(note or {})}, f, indent=2,
              sort_keys=True)
  return written


def export_run(workdir: str, out_dir: str, *, model_type: str = "mixtral", lora: str = "merge",
               layout: str = "checkpoint", step: Optional[int] = None) -> dict:
  """Exports the run in ``workdir`` (its newest checkpoint, or ``step``); see the module doc."""
  from moejax.train import load as load_lib  # pylint: disable=g-import-not-at-top
  cfg = load_lib.run_config(workdir)
  model, step = load_lib.model_at(cfg, workdir, step)
  _, params, router_state, _ = nnx.split(model, nnx.Param, nnx.Variable, ...)
  ft = cfg.finetune
  return export_params(nnx.to_pure_dict(params), nnx.to_pure_dict(router_state), cfg.model,
                       out_dir, model_type=model_type, lora=lora, lora_rank=ft.lora_rank,
                       lora_alpha=ft.lora_alpha, layout=layout,
                       note={"run": os.path.abspath(workdir), "step": int(step),
                             "finetune_source": ft.source})
