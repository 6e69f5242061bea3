r"""How often a trained model's tokens meet other experts under numerical perturbations.

Usage:
  python -m experiments.routing_consistency --workdir=/tmp/moejax_mixtral \
      --json_out=/tmp/consistency.json
  python -m experiments.routing_consistency --workdir=W --json_out=C.json \
      --perturbations=bf16,int8,int4 --batches=2

Restores the run's latest checkpoint (``--step`` for another), takes
``--batches`` validation batches of the run's data (``--rows`` keeps the
first rows of them), and compares the routing of the model's own forward
with each perturbed forward (:mod:`moejax.serve.routing_consistency`): bf16
compute, int8 / int4 experts, KV-cached decoding, 4 micro-batches,
expert-parallel degrees 1 / 2 / 8, the forward that remat recomputes, and
the Hugging Face round trip of a Mixtral-routed model. A perturbation that
does not apply says why as ``n/a``.

Writes the JSON (per perturbation the flip rate, the token flip share and the
per-layer flip rates; per layer the near-tie margins' histogram) to
``--json_out`` and the plot beside it (same name, ``.png``), and prints one
line per perturbation.

On CPU the expert-parallel degrees run on 8 simulated devices: this binary
sets ``JAX_NUM_CPU_DEVICES=8`` unless it is set already.
"""

from __future__ import annotations

import os

# Before JAX starts: the expert-parallel perturbations use sub-meshes of 8 devices.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import json  # noqa: E402
import sys  # noqa: E402

from absl import app, flags  # noqa: E402

from experiments import cli  # noqa: E402
from experiments import common_flags  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "a training run (config.json + checkpoints)")
_STEP = common_flags.step()
_JSON_OUT = common_flags.json_out()
_PERTURBATIONS = flags.DEFINE_list("perturbations", None,
                                   "perturbations to run (default: every registered one)")
_BATCHES = flags.DEFINE_integer("batches", 1, "validation batches of the run's data")
_ROWS = flags.DEFINE_integer("rows", None, "keep the first rows of the batches (default: all)")
flags.mark_flags_as_required(["workdir"])


def _check_flags() -> tuple:
  """The perturbation names, or one ``error:`` line naming the flag (before any compute)."""
  from moejax.serve import routing_consistency as rc  # pylint: disable=g-import-not-at-top
  if not _JSON_OUT.value:
    cli.fail("--json_out is not set: the JSON is the result (the plot goes beside it). "
             "Fix: --json_out=/tmp/routing_consistency.json")
  if _BATCHES.value < 1:
    cli.fail(f"--batches={_BATCHES.value}: needs at least one batch. Fix: --batches=1")
  if _ROWS.value is not None and _ROWS.value < 1:
    cli.fail(f"--rows={_ROWS.value}: needs at least one row. Fix: omit --rows or --rows=8")
  names = tuple(_PERTURBATIONS.value or sorted(rc.PERTURBATIONS))
  unknown = [n for n in names if n not in rc.PERTURBATIONS]
  if unknown:
    cli.fail(f"--perturbations: unknown {', '.join(unknown)}. Fix: pick from "
             f"{','.join(sorted(rc.PERTURBATIONS))}")
  cli.check_writable_file("--json_out", _JSON_OUT.value, "routing_consistency.json")
  return names


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  names = _check_flags()
  # pylint: disable=g-import-not-at-top
  import numpy as np
  from moejax.ablation.analysis import val_batches
  from moejax.config import ConfigError
  from moejax.serve import consistency_report as report_lib
  from moejax.serve.generate import load_run
  from moejax.train.checkpoint import WorkdirError

  try:
    cfg, model, step = load_run(_WORKDIR.value, _STEP.value)
    if cfg.model.moe is None:
      raise ValueError(f"--workdir={_WORKDIR.value} is a dense model: nothing is routed. "
                       "Fix: pass a MoE run")
    batches, _ = val_batches(cfg, _BATCHES.value)
  except (ConfigError, FileNotFoundError, ValueError, WorkdirError) as e:
    cli.fail(f"{type(e).__name__}: {e}")
  tokens = np.concatenate([np.asarray(b["inputs"]) for b in batches])[:_ROWS.value]
  report = report_lib.evaluate(model, [tokens], names)
  out = {"workdir": os.path.abspath(_WORKDIR.value), "step": int(step),
         "rows": int(tokens.shape[0]), "seq_len": int(tokens.shape[1]), **report.to_json()}
  with open(cli.file_to_write(_JSON_OUT.value), "w", encoding="utf-8") as f:
    json.dump(out, f, indent=2, sort_keys=True)
  png = os.path.splitext(_JSON_OUT.value)[0] + ".png"
  report_lib.plot(report, png)
  for name, row in report.perturbations.items():
    if "n/a" in row:
      print(f"{name:12s} n/a: {row['n/a']}")
    else:
      print(f"{name:12s} flip rate {row['flip_rate']:.4f}, tokens with a flip "
            f"{row['token_flip_share']:.4f}")
  print(f"--- {_WORKDIR.value} step {step}, {report.tokens} tokens; wrote {_JSON_OUT.value} "
        f"and {png}", file=sys.stdout, flush=True)


if __name__ == "__main__":
  cli.run(main)
