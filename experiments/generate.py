r"""Generates text with a trained run: ``python -m experiments.generate --workdir=W --prompt=...``.

Usage:
  python -m experiments.generate --workdir=/tmp/moejax_default --prompt="def main(" \
      --max_new_tokens=200 --temperature=0.8 --top_p=0.95
  python -m experiments.generate --workdir=W --prompt="import os" --prompt="class A:" \
      --quantize=int4 --seed=1      # a batch of two prompts, int4 experts

Restores the latest checkpoint (``--step`` for another), encodes each
``--prompt`` with the run's tokenizer (bytes today: the document separator
then the UTF-8 bytes), left-pads the batch, prefills it and decodes through
the KV cache (:mod:`moejax.serve`) until every row emits the end-of-document
token or ``--max_new_tokens``. ``--temperature=0`` is greedy. Prints each
prompt and its continuation, then the prefill time and decode tokens / s
(compilation included: the first call of each shape compiles).

Exit status 1 with the reason for a model that cannot be decoded (expert
choice, Soft MoE: not causal), a bad sampling flag or a missing checkpoint.
"""

from __future__ import annotations

from absl import app, flags

from experiments import cli
from experiments import common_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "a training run (config.json + checkpoints)")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "prompt text; repeat for a batch")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "new tokens per prompt at most")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus mass (1: off)")
_TOP_K = flags.DEFINE_integer("top_k", 0, "top-k filter (0: off)")
_SEED = common_flags.seed()  # sampling
_STEP = common_flags.step()
_QUANTIZE = flags.DEFINE_string("quantize", "none",
                                "expert weights: none, int8, int4 or int<bits>_g<group>")
_BACKEND = flags.DEFINE_string("backend", None, "MoE execution backend (default: the run's)")
_STOP = flags.DEFINE_bool("stop_at_end_of_document", True,
                          "stop a row at the tokenizer's end-of-document token")
flags.mark_flags_as_required(["workdir", "prompt"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from moejax.config import ConfigError
  from moejax.serve import Decoder, SamplingConfig, generate, get_tokenizer
  from moejax.serve import quantize as quant_lib
  from moejax.serve.generate import load_run
  from moejax.train.checkpoint import WorkdirError

  try:
    sampling = SamplingConfig(temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                              top_p=_TOP_P.value)
    qcfg = None
    if _QUANTIZE.value != "none":
      qcfg = quant_lib.QuantConfig.parse(_QUANTIZE.value)
    cfg, model, step = load_run(_WORKDIR.value, _STEP.value)
    tok = get_tokenizer(cfg.data, cfg.model.vocab_size)
    if qcfg is not None:
      quant_lib.quantize_model(model, qcfg)
    dec = Decoder(model, backend=_BACKEND.value)
  except (ConfigError, FileNotFoundError, ValueError, WorkdirError) as e:
    cli.fail(f"{type(e).__name__}: {e}")
  prompts = [tok.encode(p) for p in _PROMPT.value]
  out = generate(dec, prompts, max_new_tokens=_MAX_NEW.value, sampling=sampling,
                 seed=_SEED.value, stop_id=tok.stop_id if _STOP.value else None)
  for text, new, stopped in zip(_PROMPT.value, out.tokens, out.stopped):
    print(f"--- prompt: {text!r}{' (end of document)' if stopped else ''}")
    print(text + tok.decode(new))
  new_tokens = sum(len(t) for t in out.tokens)
  print(f"--- {_WORKDIR.value} step {step}, {len(prompts)} prompt(s), {new_tokens} new tokens; "
        f"prefill {out.prefill_s:.3f}s, decode {out.steps} steps in {out.decode_s:.3f}s "
        f"({len(prompts) * out.steps / max(out.decode_s, 1e-9):.1f} tokens/s, compiles included)")


if __name__ == "__main__":
  cli.run(main)
