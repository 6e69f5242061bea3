r"""Prints the parameter / FLOP budget of model configs.

Usage:
  python -m experiments.params --preset=deepseek_v3
  python -m experiments.params --preset=all
  python -m experiments.params --config=configs/presets/mixtral_8x7b.py \
      --config.model.moe.topology.num_experts=64 --seq_len=2048

For each model: total parameters, active parameters per token (matmul
convention: LM head counted, input embedding table not; 'active+emb' adds
it), forward FLOPs per token at --seq_len, the per-component breakdown and,
for presets (or configs carrying a ``published`` entry), the published
numbers with our % error. Conventions: moejax/topology/accounting.py.

Then the serving memory (``--memory``, on by default): weight GB at fp32 /
bf16 / fp8 / int8 / int4 with the number of ``--device_gb`` accelerators
needed to hold them, and the KV cache per token and for ``--batch``
sequences of ``--seq_len`` tokens. Quantised formats quantise the attention
and FFN / expert matrices with one ``--scale_bits`` scale per
``--group_size`` input rows (0: per output channel) and keep embeddings, LM
head, norms and routers at 16 bits. Conventions: moejax/topology/memory.py.

  python -m experiments.params --preset=mixtral_8x22b --device_gb=80
  python -m experiments.params --preset=deepseek_v3 --seq_len=32768 --batch=8 --group_size=0
  python -m experiments.params --preset=gpt_oss_120b --quantized=routed_experts \
      --group_size=32 --scale_bits=8     # MXFP4-like experts, the rest in bf16
"""

from __future__ import annotations

import pathlib

from absl import app, flags
from ml_collections import config_flags

from moejax.config import ArchitectureConfig, ConfigError, ModelConfig, files, from_dict
from moejax.topology import accounting, memory

_PRESET = flags.DEFINE_string(
    "preset", None, "preset name from configs/presets (or 'all' for every preset)")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Python config file whose get_config() has a 'model' subtree",
    lock_config=True)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096,
                                 "sequence length S for attention FLOPs and the KV-cache context")
_MEMORY = flags.DEFINE_bool("memory", True, "print the serving memory table")
_GROUP = flags.DEFINE_integer("group_size", 128,
                              "input rows per quantisation scale (0: one per output channel)")
_SCALE_BITS = flags.DEFINE_integer("scale_bits", 16, "bits per quantisation scale")
_QUANTIZED = flags.DEFINE_list("quantized", list(memory.QUANTIZABLE),
                               "components whose matrices the fp8 / int8 / int4 columns "
                               "quantise (the rest stays at 16 bits)")
_BATCH = flags.DEFINE_integer("batch", 1, "sequences in the KV-cache column")
_KV_BITS = flags.DEFINE_integer("kv_bits", 16, "bits per cached key / value number")
_DEVICE_GB = flags.DEFINE_float("device_gb", 80.0, "accelerator memory in GB (1e9 bytes)")


def _published(cfg) -> dict | None:
  pub = cfg.get("published") if hasattr(cfg, "get") else None
  if pub is None:
    return None
  return pub.to_dict() if hasattr(pub, "to_dict") else dict(pub)


def collect(preset: str | None, config, seq_len: int, models: dict | None = None):
  """(label -> Budget, label -> published) for the requested models.

  models: when given, filled with label -> (ModelConfig, ArchitectureConfig).
  """
  budgets, published = {}, {}
  models = {} if models is None else models
  if preset is not None:
    names = files.list_presets() if preset == "all" else [preset]
    for name in names:
      preset = files.load_preset(name)  # ValueError lists the valid names
      budgets[name] = accounting.budget(preset.model, seq_len, preset.architecture)
      models[name] = (preset.model, preset.architecture)
      published[name] = preset.published
  if config is not None:
    if "model" not in config:
      raise ConfigError("config", sorted(config.keys()), "has no 'model' subtree",
                        "return {'model': {...}} from get_config()")
    path = config_flags.get_config_filename(flags.FLAGS["config"])
    label = pathlib.Path(path).stem
    model = from_dict(ModelConfig, config.model, "model")
    arch = (from_dict(ArchitectureConfig, config.accounting, "accounting")
            if "accounting" in config else ArchitectureConfig())
    pub = _published(config)
    if pub:
      # Published numbers describe the file as written, not an overridden arm.
      as_written = from_dict(ModelConfig, files.load_config_file(path).model, "model")
      if as_written != model:
        label, pub = label + " (overridden)", None
    if label in budgets:
      label += " (--config)"
    budgets[label] = accounting.budget(model, seq_len, arch)
    models[label] = (model, arch)
    if pub:
      published[label] = pub
  return budgets, published


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _PRESET.value is None and _CONFIG.value is None:
    raise app.UsageError("give --preset=NAME (or all) and/or --config=path/to/config.py; "
                         f"presets: {', '.join(files.list_presets())}")
  for flag in (_BATCH, _KV_BITS, _SCALE_BITS):
    if flag.value <= 0:
      raise app.UsageError(f"--{flag.name}={flag.value}: must be > 0")
  if _GROUP.value < 0 or _DEVICE_GB.value <= 0:
    raise app.UsageError(f"--group_size={_GROUP.value} must be >= 0 (0: per channel) and "
                         f"--device_gb={_DEVICE_GB.value} > 0")
  models = {}
  try:
    budgets, published = collect(_PRESET.value, _CONFIG.value, _SEQ_LEN.value, models)
  except (ValueError, ConfigError) as e:
    raise app.UsageError(str(e)) from e
  print(accounting.budget_table(budgets, published))
  if _MEMORY.value:
    try:
      formats = memory.standard_formats(group_size=_GROUP.value or None,
                                        scale_bits=_SCALE_BITS.value, quantized=_QUANTIZED.value)
    except ValueError as e:
      raise app.UsageError(f"--quantized: {e}") from e
    print()
    print(memory.memory_table(models, formats, context=_SEQ_LEN.value, batch=_BATCH.value,
                              kv_bits=_KV_BITS.value, device_gb=_DEVICE_GB.value))


if __name__ == "__main__":
  app.run(main)
