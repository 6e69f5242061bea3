"""How a fine-tuning run starts: the trainer's start hook (:class:`moejax.train.context.StartHook`).

Fine-tuning builds on training, not the other way: the training loop knows
nothing of sources or accounting, and takes this hook instead
(``loop.train(cfg, workdir, start=finetune_start)``; ``experiments.train``,
``experiments.finetune`` and the ablation runner always pass it). It runs
with the trainer's read-only checks, before the workdir is locked:

- a fresh run (no checkpoint of its own yet) opens and checks its source
  (:func:`moejax.finetune.source.open_source`), says where its model differs
  from the source's, and returns the :class:`~moejax.finetune.source.Source`,
  whose ``apply`` gives the run its first state; a resumed run never reads
  the source again;
- every start and resume prints the options, the domains the loss covers
  (:func:`moejax.finetune.scope.loss_scope`) and the accounting
  (:mod:`moejax.finetune.accounting`) of the run, with the compute its
  source's training cost (:func:`~moejax.finetune.accounting.compute_line`).

A run from scratch (``finetune.source`` empty) gets None: nothing is said
or changed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import optax

from moejax.finetune import accounting as accounting_lib
from moejax.finetune import source as source_lib
from moejax.finetune.scope import loss_scope
from moejax.train.config import ExperimentConfig


def options(cfg: ExperimentConfig) -> str:
  """The fine-tuning options of ``cfg`` in words (the trainer's first line about them)."""
  ft = cfg.finetune
  parts = [f"from {ft.source}"]
  if ft.freeze:
    parts.append(f"frozen: {', '.join(ft.freeze)}")
  if ft.lora:
    parts.append(f"LoRA rank {ft.lora_rank} (x{ft.lora_scale:g}) on {', '.join(ft.lora)}")
  if ft.controller != "auto":
    parts.append(f"bias controller {ft.controller}")
  if ft.source_format == "upcycle":
    up = ft.upcycle
    parts.append(f"upcycled (split {up.split}, noise {up.noise:g}, drop {up.drop:g}, "
                 f"renormalize {up.renormalize}, router {up.router_init})")
  return "; ".join(parts)


def finetune_start(cfg: ExperimentConfig, *, fresh: bool, abstract_params: Any,
                   tx: optax.GradientTransformation,
                   say: Callable[[str], None]) -> Optional[source_lib.Source]:
  """The start hook of the trainer (see the module docstring)."""
  if not cfg.finetune.enabled:
    return None
  source = None
  if fresh:  # a fine-tuning run starts from its source (checked here, read-only)
    source = source_lib.open_source(cfg)
    for note in source.notes:
      say(f"note: this run's model differs from its source in {note}")
  say(f"fine-tuning ({options(cfg)}); {loss_scope(cfg)}")
  say("accounting before training:")
  say(accounting_lib.table({"this run": accounting_lib.accounting(cfg, abstract_params, tx)}))
  say(accounting_lib.compute_line(cfg))
  return source
