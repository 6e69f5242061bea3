"""Plots of a suite summary: levels, differences to the baseline, curves, load heat maps.

Legend: n seeds of an arm, L MoE layers, E_r routed columns.

Every function draws from the summary dict alone (moejax.ablation.summary;
the curves and load matrices are its per-arm ``curves`` / ``load``, see
moejax.ablation.curves), so the same figure comes from a suite directory
(its ``plots/``) and from a committed ``results/ID.json`` (RESULTS.md's
images, moejax.results.images). Design rules, so that a picture does not
overstate a result:

- no bar charts; values are dots with their 95% interval over seeds (and
  the single seeds as small hollow circles);
- honest value axes (:func:`honest_axis`): an axis starts at 0 unless that
  would squeeze the data into under half of it, and then its panel title
  says "zoomed: axis does not start at 0". An axis is never zoomed onto a
  spread under 1% of the values (such a difference would fill the panel);
- every difference carries its intervals: the 95% interval over seeds and,
  for the validation loss, over validation documents (both in the
  differences plot, and in the level plot as baseline + Δ beside each arm);
  where one cannot exist (one seed, no per-document losses) the panel says
  so;
- every panel has a title; every axis says what it measures and its unit;
- a timing (latency, throughput, time speed-up) is measured on whatever
  machine ran the suite, here a CPU shared with other jobs: every timing
  panel says :data:`TIMING_CAVEAT`;
- heat maps side by side share ONE colour scale (:func:`shared_heatmaps`),
  so equal colours are equal values in every panel;
- a metric no arm has is left out (no empty or "n/a" panels); curves show
  the mean over seeds with the band between the lowest and the highest
  seed; the final point of a validation curve is the whole split (earlier
  points are the trainer's fixed ``train.eval_batches`` subset), so it is
  drawn as its own marker;
- PNG at 150 dpi, without date or version metadata (:func:`save`).

Figures are built with matplotlib's object API on an Agg canvas, never
pyplot, so a notebook's backend stays as it is. Artists that tests look for
carry a ``gid`` (``level:ARM``, ``seeds:ARM``, ``documents:ARM``, ``band:ARM``).
"""

from __future__ import annotations

import io
import math
import os
from typing import Mapping, Optional, Sequence

import numpy as np

from moejax.ablation.columns import (ARM_COLUMNS, METRICS, VERDICT_METRICS, present,
                                     skip_constant_zero)

DPI = 150
ZOOMED = "zoomed: axis does not start at 0"
TIMING_CAVEAT = "timed on a shared CPU; not a speed claim"
TIMING_METRICS = frozenset({"moe_latency_p50_ms", "moe_latency_p99_ms", "tokens_per_s",
                            "speedup_time"})
NO_SEED_INTERVAL = "one seed with a value: no interval over seeds"
# (curve key of moejax.ablation.curves, panel title, unit)
CURVE_PANELS = (("eval/loss", "validation loss", "nats/token"),
                ("train/loss", "training loss", "nats/token"),
                ("train/max_vio_batch", "MaxVio batch (training batches)", "max/mean load - 1"),
                ("eval/max_vio_global", "MaxVio global", "max/mean load - 1"))
_DIFF_SEEDS, _DIFF_DOCS = "k", "m"   # colours of Δ's intervals in the level plot


def _figure(size):
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=size, layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def _ticks(ax, integer_x: bool = False):
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top
  ax.xaxis.set_major_locator(MaxNLocator(5, integer=integer_x))


def _axis_label(key: str) -> str:
  title, unit, _ = METRICS[key]
  return f"{title} ({unit})"


def _grid(n: int, ncol: int, size=(4.2, 2.9)):
  ncol = min(ncol, n)
  nrow = math.ceil(n / ncol)
  fig = _figure((size[0] * ncol, size[1] * nrow))
  axes = fig.subplots(nrow, ncol, squeeze=False).flat
  for ax in list(axes)[n:]:
    ax.remove()
  return fig, list(fig.axes)


def honest_axis(ax, lo: float, hi: float, axis: str = "x") -> bool:
  """Limits of ``ax``'s value axis for data in [lo, hi]: from 0 unless the data would then fill
  under half of it (and their spread is at least 1% of their size); True when zoomed."""
  top = max(abs(lo), abs(hi)) or 1.0
  tiny = (hi - lo) < 0.01 * top
  if lo >= 0 and (lo <= 0.5 * hi or tiny):
    lim, zoomed = (0.0, 1.08 * (hi or 1.0)), False
  elif hi <= 0 and (hi >= 0.5 * lo or tiny):
    lim, zoomed = (1.08 * (lo or -1.0), 0.0), False
  else:
    pad = 0.12 * (hi - lo)
    lim, zoomed = (lo - pad, hi + pad), lo > 0 or hi < 0
  (ax.set_xlim if axis == "x" else ax.set_ylim)(*lim)
  return zoomed


def _title(ax, title: str, key: str = "", zoomed: bool = False) -> None:
  """The panel title, with the zoom and timing caveats on their own lines."""
  lines = [title] + ([ZOOMED] if zoomed else []) + ([TIMING_CAVEAT] if key in TIMING_METRICS
                                                    else [])
  ax.set_title("\n".join(lines), fontsize=8)


def png_bytes(fig, dpi: int = DPI, metadata: Optional[Mapping[str, str]] = None) -> bytes:
  """``fig`` as PNG with ``metadata`` as tEXt entries and no Software / date entry (so equal
  figures give equal bytes), in a 256-colour palette: a third of the bytes of the RGBA
  file, the same picture (line plots and colour maps have few colours)."""
  from PIL import Image, PngImagePlugin  # pylint: disable=g-import-not-at-top
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
  image = Image.open(buf).convert("RGB")
  info = PngImagePlugin.PngInfo()
  for key, value in (metadata or {}).items():
    info.add_text(key, value)
  out = io.BytesIO()
  image.quantize(256, method=Image.Quantize.MEDIANCUT).save(out, format="png", pnginfo=info,
                                                            optimize=True)
  return out.getvalue()


def save(fig, path: str, metadata: Optional[Mapping[str, str]] = None) -> str:
  """``fig`` as a PNG file at :data:`DPI` (:func:`png_bytes`)."""
  with open(path, "wb") as f:
    f.write(png_bytes(fig, DPI, metadata))
  return path


def _baseline_mean(summary: Mapping, entry: Mapping, key: str) -> Optional[float]:
  base = entry.get("baseline", summary.get("baseline"))
  m = summary["arms"].get(base, {}).get("metrics", {}).get(key)
  return None if m is None else m["interval"]["mean"]


def _level_row(ax, summary, name, i, y, key, extent) -> None:
  """One arm of a level panel: seeds, mean, interval; then baseline + Δ with Δ's intervals."""
  m = summary["arms"][name]["metrics"].get(key)
  if m is None:
    return
  iv = m["interval"]
  vals = list(m["values"].values())
  extent.extend(vals + [iv["mean"]])
  ax.plot(vals, [y] * len(vals), "o", mfc="none", color="0.55", ms=4)
  if iv["lo"] is not None:
    ax.plot([iv["lo"], iv["hi"]], [y, y], "-", color=f"C{i}", lw=2, gid=f"level:{name}")
    extent.extend([iv["lo"], iv["hi"]])
  ax.plot([iv["mean"]], [y], "o", color=f"C{i}", ms=6)
  entry = (summary.get("comparisons") or {}).get(name, {}).get(key)
  base = None if entry is None else _baseline_mean(summary, entry, key)
  if base is None:
    return
  for diff, dy, color, gid in ((entry["diff"], 0.2, _DIFF_SEEDS, "seeds"),
                               (entry.get("documents"), 0.32, _DIFF_DOCS, "documents")):
    if diff and diff.get("lo") is not None:
      xs = [base + diff["lo"], base + diff["hi"]]
      # end caps: a short interval stays visible on a zero-based axis
      ax.plot(xs, [y - dy] * 2, "-|", color=color, lw=1.3, ms=5, gid=f"{gid}:{name}")
      extent.extend(xs)
    elif gid == "documents" and key == "val_loss":
      ax.annotate("no interval over documents", (0.99, y - dy), ha="right", va="center",
                  xycoords=("axes fraction", "data"), fontsize=6, color=_DIFF_DOCS)


def _legend_handles(items):
  from matplotlib.lines import Line2D  # pylint: disable=g-import-not-at-top
  return [Line2D([], [], color=c, lw=lw, marker=mk, mfc=mfc, ls=ls, label=label)
          for label, c, lw, mk, mfc, ls in items]


def plot_metrics(summary: Mapping, path: Optional[str] = None,
                 keys: Optional[Sequence[str]] = None):
  """One level panel per metric: per arm mean, 95% interval over seeds, each seed; beside each
  compared arm, baseline + Δ with Δ's interval over seeds (and documents, val loss)."""
  keys = list(keys) if keys is not None else skip_constant_zero(summary,
                                                                 present(summary, ARM_COLUMNS))
  keys = [k for k in keys if any(k in a["metrics"] for a in summary["arms"].values())]
  names = list(summary["arms"])
  if not keys:
    return None
  fig, axes = _grid(len(keys), 3, (4.2, 0.5 * len(names) + 1.5))
  base = summary.get("baseline")
  for ax, key in zip(axes, keys):
    extent: list[float] = []
    for i, name in enumerate(names):
      _level_row(ax, summary, name, i, len(names) - 1 - i, key, extent)
    if base in summary["arms"] and key in summary["arms"][base]["metrics"]:
      ax.axvline(summary["arms"][base]["metrics"][key]["interval"]["mean"], color="0.6", ls=":",
                 lw=1)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([n + (" (baseline)" if n == base else "") for n in reversed(names)],
                       fontsize=8)
    ax.set_xlabel(_axis_label(key), fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylim(-0.6, len(names) - 0.4)
    _ticks(ax)
    ax.grid(axis="x", alpha=0.3)
    _title(ax, METRICS[key][0], key, honest_axis(ax, min(extent), max(extent)))
  one_seed = all(len(a["seeds"]) < 2 for a in summary["arms"].values())
  fig.suptitle(f"{summary.get('suite', '')}: per arm the mean (dot), 95% interval over seeds "
               "(coloured line), single seeds (circles)"
               + (f"; {NO_SEED_INTERVAL}" if one_seed else ""), fontsize=9)
  if summary.get("comparisons"):
    fig.legend(handles=_legend_handles([
        ("baseline + Δ: 95% over seeds (paired)", _DIFF_SEEDS, 1.3, None, None, "-"),
        ("baseline + Δ: 95% over documents (val loss)", _DIFF_DOCS, 1.3, None, None, "-")]),
        loc="outside lower center", ncols=2, fontsize=7, frameon=False)
  if path:
    save(fig, path)
  return fig


def _difference_row(ax, name, e, y, extent) -> None:
  d = e["diff"]
  if d["lo"] is not None:
    ax.plot([d["lo"], d["hi"]], [y, y], "-", color="C0", lw=3, alpha=0.8, gid=f"seeds:{name}")
    extent.extend([d["lo"], d["hi"]])
  else:
    ax.annotate(NO_SEED_INTERVAL, (0.5, y + 0.25), xycoords=("axes fraction", "data"),
                ha="center", fontsize=6, color="C0")
  doc = e.get("documents")
  if doc and doc.get("lo") is not None:
    ax.plot([doc["lo"], doc["hi"]], [y - 0.18] * 2, "-", color="C1", lw=1.5,
            gid=f"documents:{name}")
    extent.extend([doc["lo"], doc["hi"]])
  elif "documents" in e:  # the val loss: says why its document interval is missing
    ax.annotate(f"no interval over documents: {e.get('documents_note', 'not computed')}",
                (0.0, y - 0.3), xycoords=("axes fraction", "data"), xytext=(3, 0),
                textcoords="offset points", fontsize=6, color="C1", va="center")
  ax.plot([d["mean"]], [y], "o", color="k", ms=5)
  extent.append(d["mean"])
  ax.annotate(e["verdict"], (1.0, y), xycoords=("axes fraction", "data"),
              xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)


def plot_differences(summary: Mapping, path: Optional[str] = None):
  """Arm - baseline per verdict metric: interval over seeds (thick), over documents (thin)."""
  comps = summary.get("comparisons") or {}
  keys = [k for k in VERDICT_METRICS if any(k in c for c in comps.values())]
  if not keys:
    return None
  names = list(comps)
  fig, axes = _grid(len(keys), 3, (4.2, 0.5 * len(names) + 1.5))
  for ax, key in zip(axes, keys):
    ax.axvline(0.0, color="0.3", lw=1)
    extent = [0.0]
    for i, name in enumerate(names):
      if key in comps[name]:
        _difference_row(ax, name, comps[name][key], len(names) - 1 - i, extent)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([n + (f"\nvs {comps[n][key].get('baseline')}"
                             if key in comps[n] and comps[n][key].get("baseline") else "")
                        for n in reversed(names)], fontsize=8)
    ax.set_xlabel(f"arm - baseline ({METRICS[key][1]})", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    honest_axis(ax, min(extent), max(extent))  # 0 is in the extent: never zoomed
    ax.set_ylim(-0.6, len(names) - 0.4)
    _ticks(ax)
    _title(ax, f"{METRICS[key][0]}: arm - baseline", key)
  others = any(e.get("baseline") for c in comps.values() for e in c.values())
  against = (f"its reference arm ({summary['baseline']} unless 'vs' names another)" if others
             else f"{summary['baseline']} (baseline)")
  fig.suptitle(f"{summary.get('suite', '')}: arm - {against}, mean (dot) with 95% intervals; "
               "verdict at the right", fontsize=9)
  fig.legend(handles=_legend_handles([
      ("95% over seeds", "C0", 3, None, None, "-"),
      ("95% over validation documents (val loss; bootstrap)", "C1", 1.5, None, None, "-")]),
      loc="outside lower center", ncols=2, fontsize=7, frameon=False)
  if path:
    save(fig, path)
  return fig


def _curve_panels(summary: Mapping):
  names = [n for n, a in summary["arms"].items() if a.get("curves")]
  panels = []
  for key, title, unit in CURVE_PANELS:
    got = {n: summary["arms"][n]["curves"][key] for n in names
           if key in summary["arms"][n]["curves"]}
    if got:
      panels.append((key, title, unit, got))
  return names, panels


def plot_curves(summary: Mapping, path: Optional[str] = None):
  """Curves over training steps per arm: mean over seeds, band lowest-highest seed."""
  names, panels = _curve_panels(summary)
  if not panels:
    return None
  fig, axes = _grid(len(panels), 2, (5.2, 3.4))
  for ax, (key, title, unit, got) in zip(axes, panels):
    whole = key.startswith("eval/")
    extent: list[float] = []
    for i, name in enumerate(names):
      if name not in got:
        continue
      c = got[name]
      steps, mean, lo, hi = (np.asarray(c[k], np.float64) for k in ("steps", "mean", "lo", "hi"))
      n, color = c["seeds"], f"C{i}"
      extent.extend([float(lo.min()), float(hi.max())])
      # The trainer's last evaluation covers the whole split; earlier ones a fixed subset.
      sub = slice(None, -1) if whole and len(steps) > 1 else slice(None)
      ax.plot(steps[sub], mean[sub], ".-", color=color, lw=1.5, ms=3,
              label=f"{name} ({n} seed{'s' if n > 1 else ''})")
      if n > 1:
        ax.fill_between(steps[sub], lo[sub], hi[sub], color=color, alpha=0.2, lw=0,
                        gid=f"band:{name}")
      if whole:
        ax.plot(steps[-1:], mean[-1:], "D", color=color, ms=5)
        if n > 1:
          ax.plot([steps[-1]] * 2, [lo[-1], hi[-1]], "-", color=color, lw=1)
    ax.set_xlabel("training step", fontsize=8)
    _ticks(ax, integer_x=True)
    ax.set_ylabel(f"{title.split(' (')[0]} ({unit})", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    zoomed = honest_axis(ax, min(extent), max(extent), axis="y")
    _title(ax, title + (": line = eval subset, diamond = whole split" if whole else ""),
           zoomed=zoomed)
  axes[0].legend(fontsize=7)
  fig.suptitle(f"{summary.get('suite', '')}: mean over seeds, band from the lowest to the "
               "highest seed", fontsize=9)
  if path:
    save(fig, path)
  return fig


def shared_heatmaps(panels: Sequence[Mapping], *, label: str, cmap: str = "viridis",
                    vmin: float = 0.0, vmax: Optional[float] = None,
                    center: Optional[float] = None, ncols: int = 1, width: float = 7.0,
                    row_height: Optional[float] = None):
  """Matrices side by side on ONE colour scale (one norm, one colour bar).

  ``panels``: ``{"title", "matrix" [rows, cols], "xlabel", "ylabel"}`` with optional
  ``"yticklabels"`` / ``"xticklabels"`` (one per row / column), in row-major order of an
  ``ncols``-column grid (``width`` inches per column, ``row_height`` per row; default from
  the matrices' rows). ``vmax``: default the largest value of any panel. ``center``: a
  diverging scale with this value at its middle colour.
  """
  from matplotlib import colors  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top
  mats = [np.asarray(p["matrix"], np.float64) for p in panels]
  if not mats:
    return None
  if vmax is None:
    vmax = max(float(np.nanmax(m)) if np.isfinite(m).any() else vmin for m in mats)
  vmax = max(vmax, vmin + 1e-9, (center if center is not None else vmin) + 1e-9)
  norm = (colors.TwoSlopeNorm(vcenter=center, vmin=vmin, vmax=vmax) if center is not None
          else colors.Normalize(vmin=vmin, vmax=vmax))
  ncols = min(ncols, len(mats))
  nrows = math.ceil(len(mats) / ncols)
  row_h = row_height or max(0.22 * max(m.shape[0] for m in mats) + 1.1, 1.6)
  fig = _figure((width * ncols, row_h * nrows + 0.4))
  axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
  for ax in axes[len(mats):]:
    ax.remove()
  im = None
  for ax, p, m in zip(axes, panels, mats):
    im = ax.imshow(m, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    ax.set_title(p["title"], fontsize=8)
    ax.set_xlabel(p.get("xlabel", ""), fontsize=8)
    ax.set_ylabel(p.get("ylabel", ""), fontsize=8)
    if p.get("xticklabels") is not None:
      ax.set_xticks(range(m.shape[1]), p["xticklabels"], rotation=30)
    else:
      ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if p.get("yticklabels") is not None:
      ax.set_yticks(range(m.shape[0]), p["yticklabels"])
    else:
      ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=7)
  bar = fig.colorbar(im, ax=axes[:len(mats)], shrink=0.9)
  bar.set_label(label, fontsize=8)
  bar.ax.tick_params(labelsize=7)
  return fig


def plot_load(summary: Mapping, path: Optional[str] = None):
  """Per arm the layer x expert load of the final evaluation (one seed), one shared scale."""
  panels = []
  for name, a in summary["arms"].items():
    load = a.get("load")
    if not load:
      continue
    rel = np.asarray(load["relative"], np.float64)                     # [L, E_r]
    panels.append({"title": f"{name} (seed {load['seed']})", "matrix": rel,
                   "xlabel": "routed expert (column index)", "ylabel": "MoE layer",
                   "yticklabels": [f"{layer} (MaxVio {row.max() - 1:.2f})"
                                   for layer, row in zip(load["layers"], rel)]})
  if not panels:
    return None
  vmax = max(2.0, max(float(p["matrix"].max()) for p in panels))
  fig = shared_heatmaps(panels, label="load / mean load of the layer (1 = balanced)",
                        cmap="RdBu_r", vmin=0.0, vmax=vmax, center=1.0)
  fig.suptitle(f"{summary.get('suite', '')}: load per MoE layer and expert, final whole-split "
               "evaluation\n(one seed per arm: expert numbers mean nothing across seeds)",
               fontsize=9)
  if path:
    save(fig, path)
  return fig


# name -> drawing function of a summary, in the order a suite directory's plots/ lists them.
PLOTS = {"metrics": plot_metrics, "differences": plot_differences, "curves": plot_curves,
         "load": plot_load}


def write_plots(summary: Mapping, plots_dir: str) -> dict:
  """``plots_dir/NAME.png`` for each of :data:`PLOTS` that has something to show."""
  os.makedirs(plots_dir, exist_ok=True)
  out = {}
  for name, draw in PLOTS.items():
    path = os.path.join(plots_dir, f"{name}.png")
    if draw(summary, path) is not None:
      out[f"{name}_png"] = path
    elif os.path.exists(path):
      os.remove(path)  # a stale plot of an earlier summary
  return out
