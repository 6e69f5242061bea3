"""RESULTS.md's images: PNGs drawn from a suite summary, stamped with the hash of their data.

For a summary ``ID`` (``results/ID.json``), ``experiments.report --results_dir
results`` writes ``results/plots/ID/NAME.png`` for each plot of
:data:`RESULT_PLOTS` whose data the summary has, and the summary's generated
block of RESULTS.md embeds them (:func:`embed_markdown`, Markdown image
links relative to RESULTS.md):

- ``differences``: arm - baseline per verdict metric with its 95% interval
  over seeds and, for the validation loss, over documents, and the verdict
  (every summary with comparisons);
- ``curves``: loss and MaxVio over training per arm, mean over seeds with
  the band from the lowest to the highest seed;
- ``load``: the layer x expert load of the final evaluation per arm, one
  shared colour scale.

The last two need the per-arm plot data of :mod:`moejax.ablation.curves`; a
summary written before it has none, and its block says so in one line with
the commands that re-run it.

Staleness: each PNG carries one tEXt entry, ``moejax:data-sha256``: the
SHA-256 of the canonical JSON of exactly what its drawing function was
given (the plot's name, :data:`VERSION` and the subset of the summary it
draws from; no date, no library version). :func:`problems` recomputes it
from the summary and names every embedded image that is missing or shows
other data; ``experiments.report --check`` and tests/results/test_report.py
fail on them. :func:`write` redraws only the images whose hash differs.
Bump :data:`VERSION` when a drawing function changes what it shows, so the
committed images count as stale and are redrawn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import struct
from typing import Callable, Mapping, Optional

from moejax.ablation import plots
from moejax.results import claims

VERSION = 1
HASH_KEY = "moejax:data-sha256"
PLOTS_DIR = "plots"


@dataclasses.dataclass(frozen=True)
class ResultPlot:
  """One image of a RESULTS.md block: the summary subset it draws, and how."""
  name: str
  caption: str
  data: Callable[[Mapping], Optional[dict]]   # None: nothing to draw (``suite``: the ID)
  draw: Callable[[Mapping], object]           # data -> matplotlib Figure
  needs_curve_data: bool                      # absent from summaries before curves.py


def _differences(s: Mapping) -> Optional[dict]:
  if not s.get("comparisons") or not any(s["comparisons"].values()):
    return None
  return {"baseline": s.get("baseline"), "comparisons": s["comparisons"]}


def _arm_field(field: str) -> Callable[[Mapping], Optional[dict]]:
  def data(s: Mapping) -> Optional[dict]:
    arms = {n: {field: a[field]} for n, a in s["arms"].items() if a.get(field)}
    return {"arms": arms} if arms else None
  return data


RESULT_PLOTS = (
    ResultPlot("differences", "differences to the baseline, 95% intervals over seeds and "
               "documents", _differences, plots.plot_differences, False),
    ResultPlot("curves", "loss and MaxVio over training, band from the lowest to the highest "
               "seed", _arm_field("curves"), plots.plot_curves, True),
    ResultPlot("load", "load per MoE layer and expert, final evaluation, one shared colour "
               "scale", _arm_field("load"), plots.plot_load, True),
    # Drawn for the claims block only (moejax.results.claims.pseudo_summary).
    ResultPlot("claims", "every claim's difference in units of its tested size, 95% over "
               "seeds", claims.claims_plot_data, claims.plot_claims, False),
)


def has_curve_data(summary: Mapping) -> bool:
  """Whether the summary was written with the per-arm plot data (moejax.ablation.curves)."""
  return any("curves" in a for a in summary["arms"].values())


def _normal(data):
  return json.loads(json.dumps(data))  # what results/ID.json gives back (tuples -> lists)


def digest(plot: ResultPlot, data: Mapping) -> str:
  blob = json.dumps({"plot": plot.name, "version": VERSION, "data": _normal(data)},
                    sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(blob.encode()).hexdigest()


def expected(sid: str, summary: Mapping) -> list[tuple[ResultPlot, dict, str]]:
  """(plot, its data, its hash) for each plot the summary ``sid`` has data for; the figures
  are titled by the ID (``lossfree@m``, not the suite name ``lossfree``)."""
  out = []
  for plot in RESULT_PLOTS:
    data = plot.data(summary)
    if data is not None:
      data = dict(data, suite=sid)
      out.append((plot, _normal(data), digest(plot, data)))
  return out


def image_path(images_dir: str, sid: str, plot: ResultPlot) -> str:
  return os.path.join(images_dir, sid, f"{plot.name}.png")


def read_png_text(path: str) -> dict[str, str]:
  """The tEXt entries of a PNG file (``{}`` for a file that is not one)."""
  with open(path, "rb") as f:
    blob = f.read()
  if blob[:8] != b"\x89PNG\r\n\x1a\n":
    return {}
  out, pos = {}, 8
  while pos + 8 <= len(blob):
    length, kind = struct.unpack(">I4s", blob[pos:pos + 8])
    chunk = blob[pos + 8:pos + 8 + length]
    if kind == b"tEXt" and b"\0" in chunk:
      key, _, value = chunk.partition(b"\0")
      out[key.decode("latin-1")] = value.decode("latin-1")
    if kind == b"IEND":
      break
    pos += 12 + length
  return out


def write(sid: str, summary: Mapping, images_dir: str) -> list[str]:
  """Draws the summary's images into ``images_dir/ID/`` where missing or stale; removes the
  images of plots it no longer has. Returns the paths drawn."""
  drawn, keep = [], set()
  for plot, data, h in expected(sid, summary):
    path = image_path(images_dir, sid, plot)
    keep.add(os.path.basename(path))
    if os.path.exists(path) and read_png_text(path).get(HASH_KEY) == h:
      continue
    os.makedirs(os.path.dirname(path), exist_ok=True)
    plots.save(plot.draw(data), path, {HASH_KEY: h})
    drawn.append(path)
  folder = os.path.join(images_dir, sid)
  if os.path.isdir(folder):
    for name in sorted(os.listdir(folder)):
      if name.endswith(".png") and name not in keep:
        os.remove(os.path.join(folder, name))  # a plot the summary no longer has data for
  return drawn


def problems(sid: str, summary: Mapping, images_dir: str) -> list[str]:
  """One line per image of the summary that is missing from ``images_dir`` or is stale."""
  out = []
  for plot, _, h in expected(sid, summary):
    path = image_path(images_dir, sid, plot)
    if not os.path.exists(path):
      out.append(f"{path}: missing")
    elif read_png_text(path).get(HASH_KEY) != h:
      out.append(f"{path}: stale (its {HASH_KEY} is not the hash of the summary's data)")
  return out


def _rerun_line(sid: str, summary: Mapping) -> str:
  cmds = (summary.get("provenance") or {}).get("commands") or []
  workdir = "DIR"
  if cmds:
    m = re.search(r"--workdir[= ](\S+)", cmds[0])
    workdir = m.group(1) if m else workdir
  suite_cmd = f"`{cmds[0]}`" if cmds else "the command that ran the suite"
  return (f"*No curves or load heat map: this summary predates curve data; re-run it with "
          f"{suite_cmd}, then `python -m experiments.report {sid}={workdir} --out RESULTS.md "
          f"--results_dir results`.*")


def embed_markdown(sid: str, summary: Mapping, base: str = "results/plots",
                   written: bool = True) -> str:
  """The images part of a generated block: a Markdown image per plot the summary has, at
  ``base/ID/NAME.png`` (relative to the Markdown file), and the one-line note of a summary
  that predates curve data. ``written=False``: the report run did not write images (no
  ``--results_dir``), and the block says so instead of linking images of other data."""
  lines = []
  if not written:
    lines.append("*Plots: not drawn by this report run (it had no `--results_dir`).*")
  else:
    for plot, _, _ in expected(sid, summary):
      link = posixpath.join(base, sid, f"{plot.name}.png")
      lines.append(f"![{sid}: {plot.caption}]({link})")
  if not has_curve_data(summary):
    lines.append(_rerun_line(sid, summary))
  return "\n" + "\n\n".join(lines) + "\n" if lines else ""
