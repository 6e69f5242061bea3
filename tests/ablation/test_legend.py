"""summary.md ends with links to its plots and a legend of the columns it shows."""

from __future__ import annotations

import os

from moejax.ablation import legend


def _metric(mean: float) -> dict:
  return {"values": {"0": mean}, "interval": {"mean": mean, "lo": None, "hi": None, "n": 1}}


SUMMARY = {
    "arms": {"aux": {"metrics": {"val_loss": _metric(2.0), "specialisation_mi_norm": _metric(0.1),
                                 "a2a_bytes_per_token": _metric(512.0)}},
             "bias": {"metrics": {"val_loss": _metric(1.9), "max_vio_global": _metric(0.3)}}},
    "comparisons": {"bias": {}},
    "mdd": {"val_loss": {"value": 0.01, "seeds": 2}},
}


def test_the_legend_defines_exactly_the_columns_shown_then_the_difference_and_mdd():
  assert legend.column_legend(SUMMARY).splitlines() == [
      "Columns:",
      "",
      "- **val loss**: cross-entropy on the whole validation split (nats/token)",
      "- **MaxVio global**: max expert load / mean load, minus 1, with the loads summed over "
      "the whole",
      "  validation split (0: balanced)",
      "- **spec. MI/H**: I(expert; domain) / H(domain) on validation: how much the chosen "
      "expert says about",
      "  a token's domain (0: nothing, 1: all of it)",
      "- **a2a B/token**: bytes per token expert parallelism over 8 devices would move "
      "all-to-all (dispatch",
      "  and combine, forward, every MoE layer) for the realised routing; computed, not "
      "measured",
      "- **\N{GREEK CAPITAL LETTER DELTA}**: the arm minus the baseline, paired over seeds",
      "- **MDD**: minimal detectable difference: the half-width of the pooled paired 95% "
      "interval over",
      "  seeds; a smaller true difference stays unresolved",
  ]
  assert max(len(line) for line in legend.column_legend(SUMMARY).splitlines()) <= legend.WIDTH


def test_the_plots_are_linked_relative_to_the_suite_directory(tmp_path):
  drawn = {"metrics_png": str(tmp_path / "plots" / "metrics.png"),
           "curves_png": str(tmp_path / "plots" / "curves.png")}
  text = legend.markdown(SUMMARY, drawn, str(tmp_path))
  assert text.startswith("Plots:\n\n- [metrics](plots/metrics.png)\n- [curves](plots/curves.png)"
                         "\n\nColumns:\n\n- **val loss**")
  assert str(tmp_path) not in text and text.endswith("\n")
  assert legend.plot_links({}, str(tmp_path)) == ""
  assert os.sep not in legend.plot_links(drawn, str(tmp_path)).replace("/", "")


def test_a_unit_with_a_minus_never_starts_a_wrapped_line_as_a_list():
  peer = {"arms": {"a": {"metrics": {"peer_key_max_vio": _metric(0.5),
                                     "probe_leak_gap": _metric(0.1)}}}}
  lines = legend.column_legend(peer).splitlines()
  assert lines[2:] == ["- **PEER sub-key MaxVio**: max/mean use minus 1",
                       "- **leak gap**: (prefix minus TF) / prefix"]
