"""The plots say what they show: titles, honest axes, intervals on differences, timing caveats,
one colour scale per heat-map figure; the curve and load data of a summary; stamped images."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from moejax.ablation import curves, plots, runner, summary as summary_lib
from moejax.results import images

ARMS = ("base", "wide", "fine")


def _summary(seeds=(0, 1, 2)) -> dict:
  """A summary of three arms (baseline ``base``) with levels far from 0, a 0.26% difference,
  a latency, a document interval for ``wide``'s val loss, curves and load matrices."""
  results = []
  for i, arm in enumerate(ARMS):
    for s in seeds:
      results.append({"arm": arm, "seed": s, "budget": {}, "val_loss": 4.0 + 0.3 * i + 0.4 * s,
                      "max_vio_global": 0.5 + 0.1 * i + 0.01 * s,
                      "a2a_bytes_per_token": 766.0 + i + 0.5 * s,
                      "moe_latency_p99_ms": 7.0 + 3 * i + s})
  summ = summary_lib.summarise_results(results, baseline="base", order=ARMS)
  summ["suite"] = "synthetic"
  summ["comparisons"]["wide"]["val_loss"]["documents"] = {"mean": 0.3, "lo": 0.25, "hi": 0.36,
                                                          "n": 100}
  summ["comparisons"]["fine"]["val_loss"]["documents"] = None
  summ["comparisons"]["fine"]["val_loss"]["documents_note"] = "no per-document losses"
  for i, arm in enumerate(ARMS):
    steps = list(range(10, 110, 10))
    mean = [5.0 - 0.02 * t - 0.1 * i for t in steps]
    summ["arms"][arm]["curves"] = {
        k: {"steps": steps, "mean": mean, "lo": [m - 0.05 for m in mean],
            "hi": [m + 0.05 for m in mean], "seeds": len(seeds)}
        for k in ("train/loss", "eval/loss", "train/max_vio_batch")}
    summ["arms"][arm]["load"] = {"seed": 0, "layers": ["layer_0", "layer_1"],
                                 "relative": [[1.0 + i, 1.0 - i * 0.5, 1.0, 1.0],
                                              [0.5, 1.5, 1.0, 1.0]]}
  return summ


def _panels(fig):
  return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def _gids(ax):
  return {line.get_gid(): line for line in ax.lines if line.get_gid()}


def test_every_panel_of_every_plot_has_a_title():
  summ = _summary()
  for name, draw in plots.PLOTS.items():
    fig = draw(summ)
    assert fig is not None, name
    for ax in _panels(fig):
      assert ax.get_title().strip(), f"{name}: a panel without a title ({ax.get_xlabel()!r})"


def test_level_axes_start_at_zero_or_say_they_are_zoomed():
  fig = plots.plot_metrics(_summary())
  by_key = dict(zip(["val_loss", "max_vio_global", "a2a_bytes_per_token", "moe_latency_p99_ms"],
                    _panels(fig)))
  for key, ax in by_key.items():
    lo, hi = ax.get_xlim()
    assert (lo <= 0 <= hi) != (plots.ZOOMED in ax.get_title()), key
  # a2a differs by 0.26% between arms: that spread must not fill the panel (it did before).
  assert by_key["a2a_bytes_per_token"].get_xlim()[0] == 0.0
  # The val loss spans 4.0 .. 5.6 with wide intervals: zoomed, and the panel says so.
  assert plots.ZOOMED in by_key["val_loss"].get_title()
  assert plots.honest_axis(by_key["val_loss"], 0.2, 0.5) is False  # from 0: half the axis
  assert by_key["val_loss"].get_xlim() == (0.0, pytest.approx(0.54))


def test_timing_panels_carry_the_caveat_and_others_do_not():
  fig = plots.plot_metrics(_summary())
  titles = {ax.get_xlabel(): ax.get_title() for ax in _panels(fig)}
  assert plots.TIMING_CAVEAT in titles["MoE P99 ms (ms)"]
  assert [t for t in titles.values() if plots.TIMING_CAVEAT in t] == [titles["MoE P99 ms (ms)"]]


def test_every_difference_is_drawn_with_its_intervals():
  summ = _summary()
  comp = summ["comparisons"]
  base_mean = summ["arms"]["base"]["metrics"]["val_loss"]["interval"]["mean"]
  # Differences plot: the seed interval of every compared arm and metric, the document
  # interval of the val loss where there is one, and a note where there is none.
  diff = plots.plot_differences(summ)
  val_ax = _panels(diff)[0]
  assert val_ax.get_title().startswith("val loss")
  lines = _gids(val_ax)
  assert list(lines["seeds:wide"].get_xdata()) == [comp["wide"]["val_loss"]["diff"]["lo"],
                                                   comp["wide"]["val_loss"]["diff"]["hi"]]
  assert list(lines["documents:wide"].get_xdata()) == [0.25, 0.36]
  assert "documents:fine" not in lines
  assert any("no interval over documents: no per-document losses" in t.get_text()
             for t in val_ax.texts)
  for ax in _panels(diff):
    assert {"seeds:wide", "seeds:fine"} <= set(_gids(ax)), ax.get_title()
  # Level plot: beside each compared arm, baseline + Δ with both intervals (the val-loss
  # panel had no document interval before).
  levels = _panels(plots.plot_metrics(summ))[0]
  lines = _gids(levels)
  assert list(lines["documents:wide"].get_xdata()) == pytest.approx([base_mean + 0.25,
                                                                     base_mean + 0.36])
  seeds = comp["fine"]["val_loss"]["diff"]
  assert list(lines["seeds:fine"].get_xdata()) == pytest.approx([base_mean + seeds["lo"],
                                                                 base_mean + seeds["hi"]])
  # One seed: no interval over seeds can exist, and the plots say so.
  one = _summary(seeds=(0,))
  assert plots.NO_SEED_INTERVAL in plots.plot_metrics(one).get_suptitle()
  assert any(plots.NO_SEED_INTERVAL in t.get_text()
             for t in _panels(plots.plot_differences(one))[0].texts)


def test_heat_maps_of_a_figure_share_one_colour_scale():
  fig = plots.plot_load(_summary())
  ims = [im for ax in _panels(fig) for im in ax.get_images()]
  assert len(ims) == 3
  assert len({id(im.norm) for im in ims}) == 1
  assert {im.get_clim() for im in ims} == {(0.0, 3.0)}  # max(2, the largest: fine 3.0)
  assert len([ax for ax in fig.axes if ax.get_label() == "<colorbar>"]) == 1
  labels = [t.get_text() for t in _panels(fig)[2].get_yticklabels()]
  assert labels == ["layer_0 (MaxVio 2.00)", "layer_1 (MaxVio 0.50)"]
  free = plots.shared_heatmaps([{"title": "a", "matrix": [[0, 1]]},
                                {"title": "b", "matrix": [[0, 7]]}], label="x")
  assert {im.get_clim() for ax in _panels(free) for im in ax.get_images()} == {(0.0, 7.0)}


def test_curves_draw_a_seed_band_per_arm_and_the_final_evaluation():
  fig = plots.plot_curves(_summary())
  titles = [ax.get_title() for ax in _panels(fig)]
  assert titles[0].startswith("validation loss: line = eval subset, diamond = whole split")
  assert titles[1].startswith("training loss") and titles[2].startswith("MaxVio batch")
  bands = {c.get_gid() for c in _panels(fig)[1].collections}
  assert bands == {"band:base", "band:wide", "band:fine"}
  assert plots.plot_curves(_summary(seeds=(0,))) is not None
  assert not [c for c in _panels(plots.plot_curves(_summary(seeds=(0,))))[1].collections
              if c.get_gid()]  # one seed: no band


def _write_metrics(path, rows):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def test_arm_curves_are_downsampled_means_with_the_seed_range(tmp_path):
  runs = []
  for seed in (0, 1):
    path = str(tmp_path / f"seed_{seed}")
    rows = [{"step": t, "split": "train", "loss": 10.0 - 0.01 * t + seed, "max_vio_batch": 0.5}
            for t in range(1, 201)]
    rows += [{"step": t, "split": "eval", "loss": 3.0 + seed} for t in (100, 200)]
    _write_metrics(path, rows + ([{"step": 201, "split": "train", "loss": 1.0}] if seed else []))
    runs.append({"arm": "a", "seed": seed, "_path": path})
  got = curves.arm_curves(runs)
  assert set(got) == {"train/loss", "train/max_vio_batch", "eval/loss"}
  c = got["train/loss"]
  assert len(c["steps"]) == curves.MAX_POINTS and c["steps"][0] == 1 and c["steps"][-1] == 200
  assert c["seeds"] == 2  # step 201 is seed 1's only: not a common step
  i = c["steps"].index(102)  # evenly spaced: round(k * 199 / 59) + 1
  assert c["steps"][:4] == [1, 4, 8, 11]
  assert (c["mean"][i], c["lo"][i], c["hi"][i]) == (9.48, 8.98, 9.98)
  assert got["eval/loss"] == {"steps": [100, 200], "mean": [3.5, 3.5], "lo": [3.0, 3.0],
                              "hi": [4.0, 4.0], "seeds": 2}
  assert list(curves.downsample(5)) == [0, 1, 2, 3, 4]


def test_arm_load_is_the_lowest_seeds_final_load_over_its_mean(tmp_path):
  assert curves.ROUTING_FILE == runner.ROUTING_FILE
  runs = []
  for seed, load in ((1, [9.0, 9.0]), (0, [1.0, 3.0])):
    path = tmp_path / f"s{seed}"
    path.mkdir()
    layers = {"layer_10": {"final_load": [2.0, 2.0]}, "layer_2": {"final_load": load}}
    (path / "routing.json").write_text(json.dumps({"layers": layers}))
    runs.append({"arm": "a", "seed": seed, "_path": str(path)})
  assert curves.arm_load(runs) == {"seed": 0, "layers": ["layer_2", "layer_10"],
                                   "relative": [[0.5, 1.5], [1.0, 1.0]]}
  assert curves.arm_load([{"arm": "d", "seed": 0, "_path": str(tmp_path)}]) is None


def test_images_carry_the_hash_of_their_data_and_go_stale_with_it(tmp_path):
  summ = _summary()
  drawn = images.write("syn", summ, str(tmp_path))
  assert sorted(os.path.basename(p) for p in drawn) == ["curves.png", "differences.png",
                                                        "load.png"]
  for plot, data, h in images.expected("syn", summ):
    text = images.read_png_text(images.image_path(str(tmp_path), "syn", plot))
    assert text == {images.HASH_KEY: h}  # no Software, no date
    assert h == images.digest(plot, json.loads(json.dumps(data)))
  assert images.problems("syn", summ, str(tmp_path)) == []
  assert images.write("syn", summ, str(tmp_path)) == []  # current: nothing redrawn
  changed = json.loads(json.dumps(summ))
  changed["arms"]["wide"]["load"]["relative"][0][0] = 1.5
  assert images.problems("syn", changed, str(tmp_path)) == [
      f"{tmp_path}/syn/load.png: stale (its {images.HASH_KEY} is not the hash of the "
      "summary's data)"]
  os.remove(tmp_path / "syn" / "curves.png")
  assert images.problems("syn", summ, str(tmp_path))[0] == f"{tmp_path}/syn/curves.png: missing"
  # A summary that lost its curves: its curves image is removed, not left behind.
  for a in changed["arms"].values():
    a["curves"] = {}
  images.write("syn", changed, str(tmp_path))
  assert sorted(os.listdir(tmp_path / "syn")) == ["differences.png", "load.png"]


def test_blocks_embed_the_images_or_say_the_summary_predates_curve_data():
  summ = _summary()
  md = images.embed_markdown("syn", summ, "results/plots")
  assert md.count("![syn: ") == 3 and "(results/plots/syn/curves.png)" in md
  assert "predates" not in md
  old = json.loads(json.dumps(summ))
  for a in old["arms"].values():
    del a["curves"], a["load"]
  old["provenance"] = {"commands": ["python -m experiments.ablate --config=c.py --workdir=/tmp/x"]}
  md = images.embed_markdown("syn", old, "results/plots")
  assert md.count("![syn: ") == 1 and "(results/plots/syn/differences.png)" in md
  assert ("*No curves or load heat map: this summary predates curve data; re-run it with "
          "`python -m experiments.ablate --config=c.py --workdir=/tmp/x`, then `python -m "
          "experiments.report syn=/tmp/x --out RESULTS.md --results_dir results`.*") in md
  assert "not drawn by this report run" in images.embed_markdown("syn", summ, written=False)
