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
"""

from __future__ import annotations

import pathlib

from absl import app, flags
from ml_collections import config_flags

from moejax.config import ArchitectureConfig, ConfigError, ModelConfig, files, from_dict
from moejax.topology import accounting

_PRESET = flags.DEFINE_string(
    "preset", None, "preset name from configs/presets (or 'all' for every preset)")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Python config file whose get_config() has a 'model' subtree",
    lock_config=True)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "sequence length S for attention FLOPs")


def _published(cfg) -> dict | None:
  pub = cfg.get("published") if hasattr(cfg, "get") else None
  if pub is None:
    return None
  return pub.to_dict() if hasattr(pub, "to_dict") else dict(pub)


def collect(preset: str | None, config, seq_len: int):
  """(label -> Budget, label -> published) for the requested models."""
  budgets, published = {}, {}
  if preset is not None:
    names = files.list_presets() if preset == "all" else [preset]
    for name in names:
      preset = files.load_preset(name)  # ValueError lists the valid names
      budgets[name] = accounting.budget(preset.model, seq_len, preset.architecture)
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
    if pub:
      published[label] = pub
  return budgets, published


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _PRESET.value is None and _CONFIG.value is None:
    raise app.UsageError("give --preset=NAME (or all) and/or --config=path/to/config.py; "
                         f"presets: {', '.join(files.list_presets())}")
  try:
    budgets, published = collect(_PRESET.value, _CONFIG.value, _SEQ_LEN.value)
  except (ValueError, ConfigError) as e:
    raise app.UsageError(str(e)) from e
  print(accounting.budget_table(budgets, published))


if __name__ == "__main__":
  app.run(main)
