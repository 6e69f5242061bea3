"""The end of ``summary.md``: links to the suite's plots and what its columns mean.

A reader of one suite directory gets the definitions next to the numbers
(docs/ablations.md has the long form): only the columns the tables show are
defined, each on one wrapped list item, and the plots are linked relative to
the directory, so the links work wherever the directory is copied.
"""

from __future__ import annotations

import os
import textwrap
from typing import Mapping

from moejax.ablation.columns import ARM_COLUMNS, METRICS, SPEEDUP_COLUMNS, present

WIDTH = 100
# Column -> what it measures, where the unit alone does not say it.
DEFINITIONS = {
    "val_loss": "cross-entropy on the whole validation split (nats/token)",
    "max_vio_batch": "max expert load / mean load, minus 1, in a training batch; mean over "
                     "the second half of training (0: balanced)",
    "max_vio_global": "max expert load / mean load, minus 1, with the loads summed over the "
                      "whole validation split (0: balanced)",
    "drop_rate": "share of token copies an expert's capacity dropped",
    "specialisation_mi_norm": "I(expert; domain) / H(domain) on validation: how much the chosen "
                              "expert says about a token's domain (0: nothing, 1: all of it)",
    "a2a_bytes_per_token": "bytes per token expert parallelism over 8 devices would move "
                           "all-to-all (dispatch and combine, forward, every MoE layer) for the "
                           "realised routing; computed, not measured",
    "spec_change": "change of spec. MI/H against the suite's source run",
}
MDD = ("MDD", "minimal detectable difference: the half-width of the pooled paired 95% interval "
       "over seeds; a smaller true difference stays unresolved")
DIFFERENCE = (chr(916), "the arm minus the baseline, paired over seeds")


def _item(term: str, text: str) -> str:
  # A " - " or " + " wrapped to the start of a line would begin a nested Markdown list (the
  # units of METRICS have them: "max/mean use - 1").
  text = text.replace(" - ", " minus ").replace(" + ", " plus ")
  return textwrap.fill(f"- **{term}**: {text}", WIDTH, subsequent_indent="  ")


def plot_links(plot_paths: Mapping[str, str], workdir: str) -> str:
  """``Plots:`` and one Markdown link per written plot, relative to ``workdir``."""
  if not plot_paths:
    return ""
  lines = ["Plots:", ""]
  for key, path in plot_paths.items():
    rel = os.path.relpath(path, workdir).replace(os.sep, "/")
    lines.append(f"- [{key.removesuffix('_png')}]({rel})")
  return "\n".join(lines)


def column_legend(summary: Mapping) -> str:
  """``Columns:`` and the definition of each metric column the tables show, MDD's too."""
  keys = present(summary, tuple(dict.fromkeys((*ARM_COLUMNS, *SPEEDUP_COLUMNS))))
  items = [_item(METRICS[k][0], DEFINITIONS.get(k, METRICS[k][1])) for k in keys]
  if summary.get("comparisons"):
    items.append(_item(*DIFFERENCE))
  if summary.get("mdd"):
    items.append(_item(*MDD))
  return "Columns:\n\n" + "\n".join(items) if items else ""


def markdown(summary: Mapping, plot_paths: Mapping[str, str], workdir: str) -> str:
  """The plots' links and the column legend, as the end of ``summary.md``."""
  parts = [p for p in (plot_links(plot_paths, workdir), column_legend(summary)) if p]
  return "\n\n".join(parts) + "\n" if parts else ""
