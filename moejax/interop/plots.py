"""Plots of a layer's routing: load bar chart and co-activation heat map.

Legend: E routed FFN experts.

Figures are built with matplotlib's object API on an Agg canvas, never
pyplot, so importing or calling this module changes no global matplotlib
state (a notebook's backend stays as it is). Each function returns the
Figure; with ``path`` it is also saved (PNG, or any format matplotlib infers
from the suffix).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from moejax.interop.analysis import LayerRouting


def _figure(size):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=size, layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def plot_load(layer: LayerRouting, path: Optional[str | os.PathLike] = None):
  """Bar chart of the load f32[E] per expert, the mean as a line, MaxVio in the title."""
  load = np.asarray(layer.load, np.float64)
  e = load.shape[0]
  fig = _figure((max(4.0, 0.35 * e + 2.0), 3.0))
  ax = fig.add_subplot()
  ax.bar(np.arange(e), load, color="tab:blue")
  ax.axhline(load.mean(), color="tab:red", linestyle="--", linewidth=1,
             label=f"mean {load.mean():.1f}")
  ax.set_xlabel("expert")
  ax.set_ylabel("token copies")
  ax.set_xticks(np.arange(e) if e <= 32 else np.arange(0, e, max(1, e // 16)))
  ax.set_title(f"{layer.name or 'layer'}: load over {layer.num_tokens} tokens, "
               f"MaxVio {layer.max_vio:.3f}")
  ax.legend(loc="upper right", fontsize="small")
  if path is not None:
    fig.savefig(path, dpi=100)
  return fig


def plot_coactivation(layer: LayerRouting, path: Optional[str | os.PathLike] = None,
                      normalize: bool = True):
  """Heat map of expert co-activation.

  With ``normalize`` cell (i, j) is P(j | i) = C[i, j] / C[i, i], the share of
  expert i's tokens that also chose j (rows of unused experts are 0);
  otherwise the raw counts C[i, j]. The diagonal (the load) is blanked: the
  bar chart shows it, and it would swamp the colour scale.
  """
  c = np.asarray(layer.coactivation, np.float64)
  if normalize:
    diag = np.diag(c)[:, None]
    c = np.where(diag > 0, c / np.where(diag > 0, diag, 1.0), 0.0)
  c = c.copy()
  np.fill_diagonal(c, np.nan)
  e = c.shape[0]
  fig = _figure((max(4.0, 0.3 * e + 2.5), max(3.5, 0.3 * e + 1.5)))
  ax = fig.add_subplot()
  im = ax.imshow(c, cmap="viridis", interpolation="nearest")
  fig.colorbar(im, ax=ax, label="P(j | i)" if normalize else "tokens")
  if e <= 32:
    ax.set_xticks(np.arange(e))
    ax.set_yticks(np.arange(e))
  ax.set_xlabel("expert j")
  ax.set_ylabel("expert i")
  ax.set_title(f"{layer.name or 'layer'}: co-activation")
  if path is not None:
    fig.savefig(path, dpi=100)
  return fig
