r"""Exports a (fine-tuned) run to a Hugging Face checkpoint directory:
``python -m experiments.export_hf --workdir=FT --out=DIR [--lora=merge|separate]``.

Writes config.json and model.safetensors of the family ``--model_type`` names (mixtral,
qwen3_moe or deepseek_v3: ``AutoModelForCausalLM.from_pretrained(DIR)`` loads them); LoRA
adapters are merged into the weights (``--lora=merge``) or kept apart in
adapter_model.safetensors + adapter_config.json (PEFT naming; ``--lora=separate``). The
model must be one the family expresses (Mixtral: every layer MoE, softmax top-k routing
without a selection bias, untied head, e.g. a run of configs/default_mixtral.py;
DeepSeek-V3: MLA attention, e.g. configs/deepseek_v3_small.py): otherwise one ``error:``
line names each field the family lacks, the family whose blocks the model's MoE layers
are, and the fix, before anything is written. See moejax/finetune/export.py,
docs/finetune.md and docs/interop.md ("What each family expresses").
"""

from __future__ import annotations

from absl import app, flags

from experiments import cli
from experiments import common_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "The run directory to export.")
_OUT = flags.DEFINE_string("out", None, "The Hugging Face checkpoint directory to write.")
_LORA = flags.DEFINE_enum("lora", "merge", ["merge", "separate"],
                          "Fold LoRA adapters into the weights, or write them apart.")
_LAYOUT = flags.DEFINE_enum("layout", "checkpoint", ["checkpoint", "fused"],
                            "checkpoint: per-expert tensors (released files, from_pretrained); "
                            "fused: transformers >= 5 in-memory parameters.")
_STEP = common_flags.step()
_MODEL_TYPE = flags.DEFINE_string("model_type", "mixtral", "The Hugging Face family of the "
                                  "whole model: mixtral, qwen3_moe or deepseek_v3 "
                                  "(docs/interop.md).")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # pylint: disable=g-import-not-at-top
  from moejax.finetune import export as export_lib
  from moejax.interop.errors import InteropError
  from moejax.train.checkpoint import WorkdirError
  cli.check_writable("--out", _OUT.value)  # before the run is read
  try:
    written = export_lib.export_run(_WORKDIR.value, _OUT.value, model_type=_MODEL_TYPE.value,
                                    lora=_LORA.value, layout=_LAYOUT.value, step=_STEP.value)
  except (InteropError, WorkdirError) as e:
    cli.fail(f"{type(e).__name__}: {e}")
  for what, path in written.items():
    print(f"  {what:<15} {path}")


if __name__ == "__main__":
  cli.run(main)
