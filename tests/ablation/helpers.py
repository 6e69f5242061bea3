"""Tiny suites for the ablation tests (configs/tiny.py, a few steps)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

from moejax.ablation.sources import seeded
from moejax.train.config import experiment_to_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITES = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs", "ablations"))
                if f.endswith(".py") and not f.startswith("_"))


def tiny_base(steps: int = 6) -> dict:
  path = os.path.join(ROOT, "configs", "tiny.py")
  spec = importlib.util.spec_from_file_location("configs_tiny_for_ablation", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  base = module.get_config().to_dict()
  base["train"].update(steps=steps, warmup_steps=1, log_every=3, eval_every=3, eval_batches=1,
                       checkpoint_every=3, keep_checkpoints=4, progress=False)
  return base


def tiny_suite(steps: int = 6, **changes) -> dict:
  """Two arms (aux loss vs loss-free bias) of configs/tiny.py at an equal budget, 2 seeds
  (the least that gives an interval over seeds)."""
  bal = lambda aux, bias: dict(aux_loss_coef=aux, bias_update="sign" if bias else "none")
  tree = dict(
      name="tiny",
      description="test suite",
      base=tiny_base(steps),
      arms={"aux": dict(model=dict(moe=dict(routing=dict(use_bias=False), balance=bal(1e-2, False)))),
            "bias": dict(model=dict(moe=dict(routing=dict(use_bias=True), balance=bal(0.0, True))))},
      fixed=dict(total=0.0, active=0.0, flops_per_token=0.0, tokens=0.0, optimizer=0.0),
      seeds=(0, 1),
      analysis=dict(routing_batches=1, comm_devices=4, causal_probe=True, latency_reps=5),
  )
  tree.update(copy.deepcopy(changes))
  return tree


def write_finished_run(path: str, exp, seed: int, **files: str) -> None:
  """A hand-made finished run of ``exp`` at ``seed`` in ``path``: the ``result.json`` that
  moejax.ablation.runner.is_finished reads, and ``files`` ({name: text}) beside it."""
  os.makedirs(path)
  with open(os.path.join(path, "result.json"), "w", encoding="utf-8") as f:
    json.dump({"experiment": json.loads(experiment_to_json(seeded(exp, seed)))}, f)
  for name, text in files.items():
    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
      f.write(text)
