"""The routing-consistency evaluation of a model on token batches: one typed report, JSON, plot.

Legend: B sequences, S tokens per sequence, N rows of every batch together.

:func:`evaluate` runs the chosen perturbations
(:mod:`moejax.serve.routing_consistency`) on the batches' rows at once and
the near-tie margins of the reference forward
(:mod:`moejax.serve.router_margins`), and returns a
:class:`ConsistencyReport`. :func:`columns` turns it into the flat numbers a
suite reports per arm; :func:`plot` draws the flip rate per layer per
perturbation and the margins' histogram.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Sequence

import numpy as np

from moejax.evaluate import consistency as consistency_lib
from moejax.serve import router_margins
from moejax.serve import routing_consistency as rc

HISTOGRAM_BINS = 30


@dataclasses.dataclass(frozen=True)
class ConsistencyReport:
  """Attributes:
    tokens: how many tokens were routed (rows x sequence length).
    perturbations: ``{name: {'flip_rate', 'token_flip_share', 'layer_flip_rate'}`` or
      ``{'n/a': why}}``.
    margins: ``{'layer_<i>': {'edges', 'counts', 'median', 'share_below_1e-3'}}``, the
      histogram of each layer's near-tie margins, plus ``'all'`` over every layer; the bins
      span [0, the 99th percentile of every layer's margins] (the long tail is cut, the
      median and the small share count every margin).
    margins_na: why there are no margins ('' when there are).
  """

  tokens: int
  perturbations: Mapping[str, Mapping]
  margins: Mapping[str, Mapping]
  margins_na: str = ""

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _histogram(m: np.ndarray, top: float) -> dict:
  h = consistency_lib.margin_histogram(m, bins=HISTOGRAM_BINS, top=top)
  h["median"] = float(np.median(m)) if m.size else None
  h["share_below_1e-3"] = float(np.mean(m < 1e-3)) if m.size else None
  return h


def evaluate(model, token_batches: Sequence, names: Optional[Sequence[str]] = None
             ) -> ConsistencyReport:
  """The report of ``model`` on the rows of ``token_batches`` (each int[B, S], same S)."""
  names = tuple(sorted(rc.PERTURBATIONS)) if names is None else rc.check_names(names)
  tokens = np.concatenate([np.asarray(t, np.int32) for t in token_batches], axis=0)
  rows = rc.measure(model, tokens, names)
  why = router_margins.why_not(model)
  margins = {}
  if not why:
    per_layer = router_margins.margins(model, tokens)
    every = np.concatenate(list(per_layer.values())) if per_layer else np.zeros(0)
    top = float(np.quantile(every, 0.99)) if every.size else 1.0
    margins = {name: _histogram(m, top) for name, m in per_layer.items()}
    margins["all"] = _histogram(every, top)
  return ConsistencyReport(tokens=int(tokens.size), perturbations=rows, margins=margins,
                           margins_na=why)


def columns(report: ConsistencyReport) -> dict:
  """``{'flip_rate_<name>', 'token_flip_share_<name>'}`` of every perturbation that ran,
  and ``margin_median`` / ``margin_share_below_1e-3`` over every layer."""
  out = {}
  for name, row in report.perturbations.items():
    if "n/a" not in row:
      out[f"flip_rate_{name}"] = row["flip_rate"]
      out[f"token_flip_share_{name}"] = row["token_flip_share"]
  if "all" in report.margins:
    out["margin_median"] = report.margins["all"]["median"]
    out["margin_share_below_1e-3"] = report.margins["all"]["share_below_1e-3"]
  return out


def _figure(size):
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=size, layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def plot(report: ConsistencyReport, path: Optional[str | os.PathLike] = None):
  """Left: flip rate per layer, one bar group per perturbation; right: the margins' histogram."""
  ran = {n: r for n, r in report.perturbations.items() if "n/a" not in r}
  layers = sorted({l for r in ran.values() for l in r["layer_flip_rate"]},
                  key=lambda l: int(l.split("_")[-1]))
  fig = _figure((11.0, 3.8))
  ax, hx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  width = 0.8 / max(len(layers), 1)
  for j, layer in enumerate(layers):
    ax.bar(np.arange(len(ran)) + j * width, [r["layer_flip_rate"][layer] for r in ran.values()],
           width, label=layer)
  ax.set_xticks(np.arange(len(ran)) + 0.4 - width / 2, list(ran), rotation=30)
  ax.set_ylabel("flip rate (share of selected pairs)")
  ax.set_title(f"flip rate per layer, {report.tokens} tokens")
  if layers:
    ax.legend(fontsize="small")
  if "all" in report.margins:
    h = report.margins["all"]
    edges = np.asarray(h["edges"])
    hx.bar(edges[:-1], h["counts"], np.diff(edges), align="edge", color="tab:gray")
    hx.set_xlabel("K-th minus (K+1)-th selection key")
    hx.set_ylabel("tokens x layers")
    hx.set_title(f"near-tie margin (median {h['median']:.3g})")
  else:
    hx.text(0.5, 0.5, f"no margins:\n{report.margins_na}", ha="center", va="center",
            wrap=True, fontsize="small", transform=hx.transAxes)
    hx.set_axis_off()
  if path is not None:
    fig.savefig(path, dpi=100)
  return fig
