r"""Routing analysis of Hugging Face MoE layers imported into moejax.

Usage:
  # a tiny randomly initialised, untrained model of a family (nothing downloaded):
  # its routing shows the mechanics, not what training teaches a router:
  python -m experiments.analyze_routing --model_type=deepseek_v3 \
      --text="def f(x): return x" --out_dir=/tmp/routing
  # a local checkpoint directory (config.json + safetensors), text through it:
  python -m experiments.analyze_routing --checkpoint=/models/qwen3-moe \
      --text_file=notes.txt --max_tokens=512 --out_dir=/tmp/routing
  # hidden states you saved (.npy, [T, d] or [B, S, d]) through chosen layers,
  # safetensors only (no torch):
  python -m experiments.analyze_routing --checkpoint=/models/mixtral \
      --hidden_states=x.npy --layers=0,15 --out_dir=/tmp/routing

Which model was analysed is the output's first line and ``model`` in summary.json.
Text is byte-level (UTF-8 bytes mod the vocabulary; no tokenizer is
needed). For text, each MoE block's input is captured from the HF model
(torch) and routed through the imported moejax layer; the max difference
from the HF block's output is reported next to the routing. Writes, under
--out_dir: summary.json (per layer: MaxVio, load entropy, load,
co-activation, parity error), trace.csv (one row per layer and token: chosen
experts and gates), load_layer<i>.png and coactivation_layer<i>.png.

Needs the interop extra (``pip install -e ".[interop]"``: torch, transformers,
safetensors); without it the binary says so in one ``error:`` line.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import sys
import textwrap
from typing import Optional, Sequence

import numpy as np
from absl import app, flags

from experiments import common_flags
from experiments import cli

_MODEL_TYPE = flags.DEFINE_string("model_type", None,
                                  "a tiny randomly initialised, untrained model of this family "
                                  "(mixtral, qwen2_moe, qwen3_moe, deepseek_v3); --checkpoint "
                                  "for a trained one")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None,
                                  "local Hugging Face checkpoint directory")
_TEXT = flags.DEFINE_string("text", None, "text to route")
_TEXT_FILE = flags.DEFINE_string("text_file", None, "file whose text to route")
_HIDDEN = flags.DEFINE_string("hidden_states", None,
                              ".npy hidden states [T, d] or [B, S, d] (with --checkpoint)")
_LAYERS = flags.DEFINE_list("layers", None, "MoE layer indices (default: all)")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 512, "route at most this many tokens")
_SEED = common_flags.seed()  # of the tiny random model
_OUT_DIR = flags.DEFINE_string("out_dir", "routing_analysis", "output directory")


def _default_text() -> str:
  import json as json_module  # a real corpus on every Python machine: stdlib source
  return pathlib.Path(json_module.decoder.__file__).read_text(encoding="utf-8")


def run(out_dir: str, *, model_type: Optional[str] = None, checkpoint: Optional[str] = None,
        text: Optional[str] = None, hidden_states: Optional[np.ndarray] = None,
        layers: Optional[Sequence[int]] = None, max_tokens: Optional[int] = 512,
        seed: int = 0) -> dict:
  """Analyses routing and writes the outputs; returns the summary dict."""
  from moejax.interop import analysis, import_moe_block, moe_layers, plots

  if (model_type is None) == (checkpoint is None):
    raise app.UsageError("give exactly one of --model_type (tiny random model) or "
                         "--checkpoint (local directory)")
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  errors: dict = {}
  token_text = None
  if hidden_states is not None:
    if checkpoint is None:
      raise app.UsageError("--hidden_states needs --checkpoint (the layers to run)")
    from moejax.interop.convert import load_hf_config

    hf_config = load_hf_config(checkpoint)
    chosen = list(layers) if layers is not None else moe_layers(hf_config)
    x = np.asarray(hidden_states, np.float32)
    x = x.reshape(-1, x.shape[-1])[:max_tokens]
    routings = [analysis.analyze_layer(import_moe_block(checkpoint, hf_config, layer=i), x,
                                       name=f"layer {i}") for i in chosen]
    source = f"hidden states {x.shape}"
  else:
    from moejax.interop import hf_models

    if checkpoint is not None:
      from transformers import AutoModelForCausalLM
      model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True,
                                                   dtype="float32").eval()
    else:
      model = hf_models.tiny_model(model_type, seed=seed, init_std=0.2, bias_std=0.1)
    text = text if text is not None else _default_text()
    routings, errors, token_text = hf_models.analyze_text(model, text, layers=layers,
                                                          max_tokens=max_tokens)
    source = f"{len(token_text)} byte tokens of text"

  summary = {"model": describe_model(model_type, checkpoint, seed), "source": source,
             "layers": []}
  for lr in routings:
    i = lr.name.split()[-1]
    plots.plot_load(lr, out / f"load_layer{i}.png")
    plots.plot_coactivation(lr, out / f"coactivation_layer{i}.png")
    entry = lr.summary()
    if errors:
      entry["max_abs_error_vs_hf"] = errors[int(i)]
    summary["layers"].append(entry)
  analysis.write_trace_csv(out / "trace.csv", routings, token_text)
  (out / "summary.json").write_text(json.dumps(summary, indent=1))

  print(textwrap.fill(f"model: {summary['model']}", 100, subsequent_indent="  "))
  print(f"{source}; outputs in {out}")
  print(f"{'layer':>8} {'MaxVio':>8} {'entropy':>8} {'max|dy|':>10}")
  for lr in routings:
    err = errors.get(int(lr.name.split()[-1]))
    print(f"{lr.name:>8} {lr.max_vio:8.3f} {lr.load_entropy:8.3f} "
          f"{'' if err is None else f'{err:10.2e}'}")
  return summary


def describe_model(model_type: Optional[str], checkpoint: Optional[str], seed: int) -> str:
  """What the routing is of: a trained checkpoint, or a random tiny model (said so)."""
  if checkpoint is not None:
    return f"the checkpoint in {checkpoint}"
  return (f"a tiny {model_type} model, randomly initialised (seed {seed}) and untrained: its "
          "routing reflects the random weights, not learned specialisation (pass "
          "--checkpoint=DIR to analyse a trained model)")


INTEROP_INSTALL = 'pip install -e ".[interop]"'


def missing_interop(hidden_states: bool) -> list[str]:
  """The interop packages this invocation needs that cannot be imported."""
  needed = ("safetensors",) if hidden_states else ("torch", "transformers", "safetensors")
  missing = []
  for name in needed:
    try:
      importlib.import_module(name)
    except ImportError:
      missing.append(name)
  return missing


def main(argv):
  del argv
  cli.check_writable("--out_dir", _OUT_DIR.value)  # before the model is built
  missing = missing_interop(bool(_HIDDEN.value))
  if missing:
    print(f"error: analyze_routing needs the interop extra ({', '.join(missing)} not "
          f"installed). Fix: {INTEROP_INSTALL}", file=sys.stderr, flush=True)
    sys.exit(1)
  text = _TEXT.value
  if _TEXT_FILE.value:
    text = pathlib.Path(_TEXT_FILE.value).read_text(encoding="utf-8")
  hidden = np.load(_HIDDEN.value) if _HIDDEN.value else None
  layers = [int(v) for v in _LAYERS.value] if _LAYERS.value else None
  run(_OUT_DIR.value, model_type=_MODEL_TYPE.value, checkpoint=_CHECKPOINT.value, text=text,
      hidden_states=hidden, layers=layers, max_tokens=_MAX_TOKENS.value, seed=_SEED.value)


if __name__ == "__main__":
  cli.run(main)
