"""Which targets a fine-tune's losses cover, said where the losses are printed.

A fine-tune usually scores a subset of the corpus's domains
(``data.loss_domains``, e.g. comments and docstrings of the standard
library): its train and validation loss are then the loss on those targets
only, and a reader comparing them with the source's loss (scored on every
domain, or on others) would compare different things. So the fine-tune says
so twice: :func:`loss_scope` in the line about its options before training,
and :func:`domain_summary` after it, with every domain's validation loss of
the last evaluation (``loss_domain/<name>`` in ``metrics.jsonl``, which
validation writes for every domain whatever ``data.loss_domains``).
"""

from __future__ import annotations

from typing import Optional

from moejax.data.config import domain_names
from moejax.train import metrics_log
from moejax.train.config import ExperimentConfig

_PREFIX = "loss_domain/"


def _scope(cfg: ExperimentConfig) -> str:
  scored = tuple(cfg.data.loss_domains)
  if not scored:
    return f"every target of {cfg.data.name} (data.loss_domains is empty)"
  context = [d for d in domain_names(cfg.data.name) if d not in scored]
  rest = f"; the {', '.join(context)} tokens are context, not scored" if context else ""
  return f"only the {', '.join(scored)} targets (data.loss_domains{rest})"


def loss_scope(cfg: ExperimentConfig) -> str:
  """``the loss covers ...``: the scored domains of ``cfg`` and those left as context."""
  return f"the loss covers {_scope(cfg)}"


def last_domain_losses(workdir: str) -> tuple[Optional[int], dict[str, float]]:
  """(step, {domain: validation loss}) of the last evaluation in ``workdir`` ((None, {}) if none)."""
  evals = metrics_log.read_metrics(workdir, "eval")
  if not evals:
    return None, {}
  last = evals[-1]
  return last.get("step"), {k[len(_PREFIX):]: float(v) for k, v in last.items()
                            if k.startswith(_PREFIX)}


def domain_summary(cfg: ExperimentConfig, workdir: str) -> str:
  """The line after a fine-tune: what its losses covered, and every domain's last val loss."""
  line = f"the train and val loss above cover {_scope(cfg)}"
  if cfg.data.loss_domains:
    line += "; the unigram baseline beside them is over every token"
  step, losses = last_domain_losses(workdir)
  if losses:
    scored = set(cfg.data.loss_domains) or set(losses)
    parts = [f"{name} {value:.4f}{'' if name in scored else ' (not in the loss)'}"
             for name, value in losses.items()]
    line += (f"; val loss of every domain at step {step}: {' | '.join(parts)} "
             f"({metrics_log.METRICS_FILE}: {_PREFIX}<name>)")
  return line


__all__ = ["domain_summary", "last_domain_losses", "loss_scope"]
