"""docs/benchmarks.md's record blocks are what the committed results/ records render to."""

import json
import pathlib

import numpy as np
import pytest

from experiments import record_blocks

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_committed_record_file_is_its_render():
  text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
  assert record_blocks.BLOCK.search(text)
  assert record_blocks.render(text) == text, "run: python -m experiments.bench_record"


def _write(tmp_path, name, rec):
  (tmp_path / "device").mkdir(exist_ok=True)
  (tmp_path / "device" / name).write_text(json.dumps(rec), encoding="utf-8")


def test_a_block_is_regenerated_from_its_record_and_missing_fields_say_so(tmp_path):
  timing = {"m": 8, "k": 4, "n": 2, "groups": 2, "dtype": "bfloat16", "variants": {
      "dense": {"fwd": {"median_s": 0.002, "tflops": 1.0, "fraction_of_dense": 1.0}},
      "kern": {"fwd": {"median_s": 0.004, "tflops": 0.5, "fraction_of_dense": 0.5},
               "fwdbwd": {"median_s": 0.01}},
      "big": {"fwd": {"error": "ValueError: too much shared memory"}}}}
  _write(tmp_path, "r.json", {"date": "D", "command": "python -m x", "note": "n",
                              "steps": {"gmm_timing": timing}, "summary": {"gmm_timing": "ok"}})
  text = ("a\n<!-- moejax:record device/r.json provenance -->\nold\n<!-- moejax:end record -->\n"
          "b\n<!-- moejax:record device/r.json gmm_timing -->\n<!-- moejax:end record -->\n")
  got = record_blocks.render(text, str(tmp_path))
  assert got == (
      "a\n<!-- moejax:record device/r.json provenance -->\n"
      "- command: `python -m x`\n- machine: not recorded\n"
      "- date and commit: in `results/device/r.json`\n"
      "- note: n\n<!-- moejax:end record -->\n"
      "b\n<!-- moejax:record device/r.json gmm_timing -->\n"
      "m=8 k=4 n=2 G=2, bfloat16, median of the timed runs:\n\n"
      "| variant | fwd ms | fwd TFLOP/s | of dense | fwd+bwd ms |\n|---|---:|---:|---:|---:|\n"
      "| `dense` | 2.00 | 1 | 1.00 | - |\n| `kern` | 4.00 | 0 | 0.50 | 10.00 |\n"
      "| `big` | failed: ValueError: too much shared memory |  |  | - |\n"
      "<!-- moejax:end record -->\n")
  assert record_blocks.render(got, str(tmp_path)) == got


def test_a_block_naming_a_missing_record_or_kind_is_one_error(tmp_path):
  _write(tmp_path, "r.json", {"steps": {}})
  with pytest.raises(record_blocks.RecordError, match="results/device/none.json"):
    record_blocks.render("<!-- moejax:record device/none.json summary -->\n"
                         "<!-- moejax:end record -->", str(tmp_path))
  with pytest.raises(record_blocks.RecordError, match="'tables'; use one of provenance"):
    record_blocks.render("<!-- moejax:record device/r.json tables -->\n"
                         "<!-- moejax:end record -->", str(tmp_path))
  with pytest.raises(record_blocks.RecordError, match="has no 'layer' for a layer block"):
    record_blocks.render("<!-- moejax:record device/r.json layer -->\n"
                         "<!-- moejax:end record -->", str(tmp_path))


def test_a_gmm_bench_record_renders_its_rows_failures_and_skips(tmp_path):
  (tmp_path / "bench").mkdir()
  rec = {"m": 8, "k": 4, "n": 2, "groups": 2, "dtype": "float32", "results": {
      "dense": {"median_s": 0.5, "tflops": 0.25, "fraction_of_dense": 1.0},
      "ragged_dot": {"median_s": 2.0, "tflops": 0.0625, "fraction_of_dense": 0.25},
      "blocked": {"median_s": 1.0, "tflops": 0.125, "fraction_of_dense": 0.5,
                  "max_rel_err_vs_ragged_dot": {"out": 1e-7, "d_lhs": 2e-7, "d_rhs": 3e-7}}},
      "failed": {"mine": {"error": "ValueError: boom"}},
      "skipped": {"pallas_gpu": "needs a GPU"}}
  (tmp_path / "bench" / "gmm.json").write_text(json.dumps(rec), encoding="utf-8")
  got = record_blocks.render("<!-- moejax:record bench/gmm.json gmm_bench -->\n"
                             "<!-- moejax:end record -->\n", str(tmp_path))
  assert got == (
      "<!-- moejax:record bench/gmm.json gmm_bench -->\n"
      "m=8 k=4 n=2 G=2, float32:\n\n"
      "| variant | median s | TFLOP/s | x dense | rel err (out, d_lhs, d_rhs) |\n"
      "|---|---:|---:|---:|---|\n"
      "| `dense` | 0.5 | 0.250 | 1.00 |  |\n"
      "| `ragged_dot` | 2 | 0.062 | 0.25 | reference |\n"
      "| `blocked` | 1 | 0.125 | 0.50 | 1.0e-07, 2.0e-07, 3.0e-07 |\n"
      "| `mine` | failed: ValueError: boom | | | |\n"
      "| `pallas_gpu` | skipped: needs a GPU | | | |\n"
      "<!-- moejax:end record -->\n")


def test_a_step_twin_record_renders_its_arms_and_ratio(tmp_path):
  (tmp_path / "bench").mkdir()
  arm = lambda ms, tok: {"median_s": ms / 1e3, "spread_s": {"min": ms / 1e3, "max": ms / 1e3},
                         "tokens_per_s": tok, "cpu_tokens_per_s": tok, "flops_per_s": 2e10,
                         "fraction_of_matmul": 0.5, "compile_s": 3.0}
  rec = {"config": "configs/default.py", "batch": 2, "seq_len": 4, "tokens_per_step": 8,
         "repeats": 3, "matmul": {"n": 64, "flops_per_s": 4e10},
         "load_1min_before": 0.5, "load_1min_after": 1.0,
         "arms": {"moe": arm(100.0, 80.0), "dense": arm(80.0, 100.0)},
         "moe_over_dense": {"tokens_per_s": 0.8, "cpu_tokens_per_s": 0.8,
                            "spread": {"min": 0.75, "max": 0.85}}}
  (tmp_path / "bench" / "step.json").write_text(json.dumps(rec), encoding="utf-8")
  got = record_blocks.render("<!-- moejax:record bench/step.json step_twin -->\n"
                             "<!-- moejax:end record -->\n", str(tmp_path)).splitlines()
  assert got[5:7] == ["| moe | 100.0 [100.0-100.0] | 80 | 80 | 20.00 | 0.50 | 3.0 |",
                      "| dense | 80.0 [80.0-80.0] | 100 | 100 | 20.00 | 0.50 | 3.0 |"]
  assert got[8] == ("MoE / dense tokens/s: 0.800 (per-round [0.750-0.850]; CPU time 0.800); "
                    "target >= 0.98")
  # Another backend's MoE arm, timed in the same rounds, gets a row and its own ratio.
  rec["arms"]["moe:whole_group"] = arm(90.0, 88.9)
  rec["alternatives_over_dense"] = {"moe:whole_group": {
      "tokens_per_s": 0.889, "cpu_tokens_per_s": 0.9, "spread": {"min": 0.8, "max": 0.95}}}
  (tmp_path / "bench" / "step.json").write_text(json.dumps(rec), encoding="utf-8")
  got = record_blocks.render("<!-- moejax:record bench/step.json step_twin -->\n"
                             "<!-- moejax:end record -->\n", str(tmp_path)).splitlines()
  assert got[7] == "| moe:whole_group | 90.0 [90.0-90.0] | 89 | 89 | 20.00 | 0.50 | 3.0 |"
  assert got[10] == ("moe:whole_group / dense tokens/s: 0.889 (per-round [0.800-0.950]; "
                     "CPU time 0.900)")
  # With the per-round times recorded, each ratio carries its bootstrap interval: every
  # resampled median of these constant arms is 80 / 90 exactly.
  rec["arms"]["moe:whole_group"]["all_s"] = [0.09] * 5
  rec["arms"]["dense"]["all_s"] = [0.08] * 5
  (tmp_path / "bench" / "step.json").write_text(json.dumps(rec), encoding="utf-8")
  got = record_blocks.render("<!-- moejax:record bench/step.json step_twin -->\n"
                             "<!-- moejax:end record -->\n", str(tmp_path)).splitlines()
  assert got[9].startswith("MoE / dense tokens/s: 0.800 (per-round")  # moe has no all_s
  assert got[10].startswith("moe:whole_group / dense tokens/s: 0.889; bootstrap 95% "
                            "[0.889-0.889] (per-round")


def test_the_twin_ratio_interval_brackets_the_ratio_of_medians():
  from experiments.benchmarks import twin as bench_twin  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  moe, dense = 0.2 + 0.02 * rng.random(40), 0.19 + 0.02 * rng.random(40)
  lo, hi = bench_twin.ratio_interval(moe, dense)
  assert lo < np.median(dense) / np.median(moe) < hi and hi - lo < 0.2
  assert (lo, hi) == bench_twin.ratio_interval(moe, dense)  # fixed seed: renders the same


def _render_bench(tmp_path, kind, rec):
  (tmp_path / "bench").mkdir(exist_ok=True)
  (tmp_path / "bench" / "r.json").write_text(json.dumps(rec), encoding="utf-8")
  return record_blocks.render(f"<!-- moejax:record bench/r.json {kind} -->\n"
                              "<!-- moejax:end record -->\n", str(tmp_path)).splitlines()


def test_an_ep_record_renders_the_suites_table_with_failed_variants_named(tmp_path):
  mib = 2.0 ** 20
  moved = {"step_s": 0.5, "x_single": 2.5, "wire": 3 * mib, "min_device": 2 * mib,
           "wire_over_min": 1.5, "copies_over_min": 1.0, "padding_waste": 0.25,
           "cross_node_share": 0.5, "min_node": mib, "cross_copies_over_min_node": 1.0,
           "meta": 0.5 * mib, "num_dropped": 3}
  rec = {"shapes": {"coarse": {"B": 2, "S": 4, "d": 8, "num_experts": 4, "top_k": 2,
                               "expert_width": 16, "devices": 2, "devices_per_node": 1,
                               "variants": {"single": {"step_s": 0.2, "x_single": 1.0},
                                            "ep_capacity": moved,
                                            "ep_ragged": {"error": "hung"}}}}}
  got = _render_bench(tmp_path, "ep_bench", rec)
  assert got[1] == "```" and got[-2] == "```"
  assert got[2].startswith("coarse: B=2 S=4 d=8 E=4 K=2 f=16, 2 devices, 1 per node")
  assert got[4].split() == ["single", "0.200", "1.00"]
  assert got[5].split() == ["ep_capacity", "0.500", "2.50", "3.00", "2.00", "1.50", "1.00",
                            "0.25", "0.50", "1.00", "1.00", "0.50", "3"]
  assert got[6].split() == ["ep_ragged", "failed:", "hung"]


def test_a_scaling_record_renders_the_suites_markdown_tables(tmp_path):
  timed = lambda s, r=None: {"median_s": s, **({"ratio_to_dense": r, "ratio_spread": {
      "min": r - 0.1, "max": r + 0.1}} if r else {})}
  point = {"E": 4, "T": 32, "load_1min_before": 1.0, "load_1min_after": 1.5,
           "variants": {"dense": {"fwd": timed(0.5), "fwdbwd": timed(1.0)},
                        "expert_matmuls": {"fwd": timed(0.5, 1.0), "fwdbwd": timed(1.1, 1.1)},
                        "blocked": {"fwd": timed(0.6, 1.2), "fwdbwd": timed(1.3, 1.3)}},
           "floor": {m: {"x_dense": 0.01, "excess_x_dense": 0.002} for m in ("fwd", "fwdbwd")}}
  rec = {"spec": {"expert_sweep_tokens": 32, "token_sweep_experts": 4, "k": 2, "f": 8,
                  "d": 16, "once_s": 30.0},
         "bandwidth": {"bytes_per_s": 4e10, "first_touch": {"bytes_per_s": 4e9}},
         "sweeps": {"experts": ["T32_E4"], "tokens": []}, "points": {"T32_E4": point}}
  got = _render_bench(tmp_path, "scaling_bench", rec)
  assert got[1] == ("E sweep, fwd+bwd (T=32, K=2, f=8, d=16, float32; copy bandwidth "
                    "40.00 GB/s, first touch 4.00 GB/s):")
  assert got[5] == ("| 4 | 1.000 | 1.30 [1.20-1.40] | 1.10 | - | - | - | 0.010 | 0.002 "
                    "| 1.0 -> 1.5 |")
  assert got[7].startswith("E sweep, fwd (T=32")


def test_a_profile_record_renders_its_spec_and_wall_split(tmp_path):
  from experiments.benchmarks import profile as bp  # pylint: disable=g-import-not-at-top
  row = lambda ms, x: {"wall_ms": dict.fromkeys(bp.ROWS, 0.0) | {"matmul": ms},
                       "traced_s": ms / 1e3, "x_dense": x, "cpu_x_dense": x,
                       "utilization": 1.0,
                       "excess_x_dense": {k: 0.0 for k in bp.ROWS} | {"matmul": ms / 800 - 1}}
  rec = {"spec": {"mode": "fwdbwd", "k": 8, "f": 256, "d": 512}, "cores": 2,
         "points": [{"T": 64, "E": 8, "variants": {"dense": row(800.0, 1.0),
                                                   "blocked": row(900.0, 1.12)}}]}
  got = _render_bench(tmp_path, "profile_bench", rec)
  assert got[1].startswith("fwdbwd, K=8, f=256, d=512, float32, 2 cores;")
  assert got[3] == "| kind (wall ms: blocked / dense (+excess x dense)) | T=64 E=8 |"
  assert "| matmul | 900 / 800 (+0.125) |" in got and "| untraced wall x dense | 1.12 |" in got
