"""experiments.benchmarks.scaling: the floor arithmetic, the ratios, the spec's errors, a
tiny run."""

import json
import pathlib
import subprocess
import sys

import pytest

from experiments.benchmarks import scaling as sc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_weight_stream_bytes_counts_three_matrices_read_twice_and_written_once():
  # E=2, d=3, f=5: each of w_gate, w_up, w_down holds 2*3*5 = 30 elements, 90 in all.
  assert sc.weight_stream_bytes(2, 3, 5) == {"fwd": 90 * 4, "fwdbwd": 3 * 90 * 4}
  assert sc.weight_stream_bytes(2, 3, 5, itemsize=2) == {"fwd": 180, "fwdbwd": 540}


def test_floor_is_the_bytes_over_the_bandwidth_as_a_ratio_to_dense():
  point = {"E": 2, "K": 1, "d": 3, "f": 5, "itemsize": 4,
           "variants": {"dense": {"fwd": {"median_s": 0.5}, "fwdbwd": {"median_s": 2.0}}}}
  sc.add_floors(point, bytes_per_s=360.0)  # 360 B = the forward's weights: 1 s
  assert point["floor"] == {"fwd": {"bytes": 360, "s": 1.0, "x_dense": 2.0},
                            "fwdbwd": {"bytes": 1080, "s": 3.0, "x_dense": 1.5}}
  no_dense = {"E": 2, "K": 1, "d": 3, "f": 5, "itemsize": 4, "variants": {}}
  sc.add_floors(no_dense, bytes_per_s=360.0)
  assert no_dense["floor"]["fwdbwd"] == {"bytes": 1080, "s": 3.0, "x_dense": None}


def test_excess_estimate_reads_the_extra_experts_twice_and_writes_their_gradient_fresh():
  # E=2 vs the dense twin's K=1 experts' worth: one extra expert, 3 x 3 x 5
  # elements = 180 B per weight set. fwd+bwd: 360 B read at 360 B/s (1 s) and
  # 180 B written at the first-touch 90 B/s (2 s): 3 s over dense's 2 s.
  point = {"E": 2, "K": 1, "d": 3, "f": 5, "itemsize": 4,
           "variants": {"dense": {"fwd": {"median_s": 0.5}, "fwdbwd": {"median_s": 2.0}}}}
  sc.add_floors(point, bytes_per_s=360.0, touch_bytes_per_s=90.0)
  fb, fw = point["floor"]["fwdbwd"], point["floor"]["fwd"]
  assert (fb["excess_bytes"], fb["excess_s"], fb["excess_x_dense"]) == (540, 3.0, 1.5)
  assert (fw["excess_bytes"], fw["excess_s"], fw["excess_x_dense"]) == (180, 0.5, 1.0)
  assert fb["x_dense"] == 1.5  # the floor itself is unchanged
  same = {"E": 4, "K": 4, "d": 3, "f": 5, "itemsize": 4, "variants": {}}
  sc.add_floors(same, bytes_per_s=360.0, touch_bytes_per_s=90.0)
  assert same["floor"]["fwdbwd"]["excess_s"] == 0.0  # E = K: dense's own weights


def _timed(all_s, cpu=1.0):
  return {"median_s": sorted(all_s)[len(all_s) // 2], "cpu_s": cpu, "all_s": all_s}


def test_ratios_pair_each_round_with_its_own_frameworks_dense():
  table = {"dense": {"fwdbwd": _timed([1.0, 2.0, 4.0], cpu=2.0)},
           "blocked": {"fwdbwd": _timed([1.5, 2.0, 4.4], cpu=3.0)},
           "torch_dense": {"fwdbwd": _timed([10.0, 10.0, 10.0])},
           "hf_mixtral": {"fwdbwd": _timed([30.0])}}  # a slow variant: one round
  sc.add_ratios(table)
  b = table["blocked"]["fwdbwd"]
  assert b["ratio_to_dense"] == 1.0 and b["cpu_ratio_to_dense"] == 1.5
  assert b["ratio_spread"]["min"] == 1.0 and b["ratio_spread"]["max"] == 1.5
  assert b["spread_s"]["min"] == 1.5 and b["spread_s"]["max"] == 4.4
  h = table["hf_mixtral"]["fwdbwd"]
  assert h["ratio_to_dense"] == 3.0 and h["ratio_spread"]["max"] == 3.0


def test_spec_errors_name_the_flag_and_the_fix():
  with pytest.raises(ValueError, match=r"error: --scaling_variants=dense,gshard: unknown "
                                       r"\['gshard'\]"):
    sc.ScalingSpec(variants=("dense", "gshard"))
  with pytest.raises(ValueError, match=r"error: --scaling_k=8 exceeds the smallest E=4"):
    sc.ScalingSpec(experts=(4, 64))
  with pytest.raises(ValueError, match=r"error: --scaling_f=0 must be >= 1"):
    sc.ScalingSpec(f=0)
  with pytest.raises(ValueError, match="both empty"):
    sc.ScalingSpec(experts=(), tokens=())


def test_points_measure_the_shared_point_once():
  spec = sc.ScalingSpec()
  assert spec.points() == [(8192, 8), (8192, 32), (8192, 64), (8192, 128), (8192, 512),
                           (2048, 64), (32768, 64)]


# One point in both sweeps (measured once): each compile costs seconds on CPU.
TINY = dict(experts=(4,), tokens=(32,), expert_sweep_tokens=32, token_sweep_experts=4,
            k=2, f=8, d=16, repeats=2, copy_mib=1, copy_repeats=2)


def test_scaling_suite_tiny_run_writes_every_point_floor_and_table():
  spec = sc.ScalingSpec(variants=("dense", "expert_matmuls", "blocked"), **TINY)
  res = json.loads(json.dumps(sc.scaling_suite(spec, {"platform": "cpu"})))
  assert res["sweeps"] == {"experts": ["T32_E4"], "tokens": ["T32_E4"]}
  assert set(res["points"]) == {"T32_E4"}
  bw = res["bandwidth"]
  assert bw["bytes_per_s"] == max(bw[w][k]["bytes_per_s"] for w in ("start", "end")
                                  for k in ("xla", "numpy")) > 0
  for p in res["points"].values():
    assert set(p["variants"]) == {"dense", "expert_matmuls", "blocked"}
    for row in p["variants"].values():
      for mode in ("fwd", "fwdbwd"):
        r = row[mode]
        assert r["runs"] == 2 and r["ratio_to_dense"] > 0 and "cpu_ratio_to_dense" in r
        assert r["ratio_spread"]["min"] <= r["ratio_spread"]["max"]
    assert p["floor"]["fwdbwd"]["bytes"] == 3 * 3 * 4 * 16 * 8 * 4
    assert p["floor"]["fwdbwd"]["x_dense"] == pytest.approx(
        p["floor"]["fwdbwd"]["s"] / p["variants"]["dense"]["fwdbwd"]["median_s"])
    assert p["load_1min_before"] >= 0 and p["load_1min_after"] >= 0
  md = sc.markdown_tables(res)
  assert md.count("| E | dense fwd+bwd s | moejax fwd+bwd x dense [spread] | matmuls alone x "
                  "dense | unfused x dense | folded x dense | HF x torch dense | floor x dense "
                  "| excess x dense | load |") == 1
  assert bw["first_touch"]["bytes_per_s"] > 0
  assert p["floor"]["fwdbwd"]["excess_bytes"] == 3 * 3 * 2 * 16 * 8 * 4  # E - K = 2
  assert md.count("| T | dense fwd s |") == 1
  row = next(line for line in md.splitlines() if line.startswith("| 32 |"))
  cells = row.split(" | ")
  assert float(cells[3]) == pytest.approx(
      round(p["variants"]["expert_matmuls"]["fwdbwd"]["ratio_to_dense"], 2))
  assert cells[4:7] == ["-", "-", "-"]  # unfused, folded and HF: not timed


@pytest.mark.slow  # imports torch and launches the binary (~40 s); the in-process run
# above covers the suite's JAX side and its JSON in the default run
def test_scaling_suite_binary_with_the_torch_peer(tmp_path):
  pytest.importorskip("transformers")
  out = tmp_path / "scaling.json"
  r = subprocess.run(
      [sys.executable, "-m", "experiments.bench", "--suite=scaling", "--scaling_experts=4",
       "--scaling_tokens=", "--scaling_expert_sweep_tokens=32", "--scaling_k=2",
       "--scaling_f=8", "--scaling_d_model=16", "--repeats=1", "--torch_threads=1",
       "--scaling_copy_mib=1", f"--json_out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  p = json.loads(out.read_text())["points"]["T32_E4"]
  assert set(p["variants"]) == set(sc.VARIANTS) and p["torch_skipped"] is None
  assert p["variants"]["hf_mixtral"]["fwdbwd"]["ratio_to_dense"] > 0
  assert "| E | dense fwd+bwd s |" in r.stdout


def test_a_list_flag_that_is_not_integers_is_one_error_line():
  from absl import app  # pylint: disable=g-import-not-at-top
  assert sc.parse_ints("scaling_tokens", [""]) == ()
  assert sc.parse_ints("scaling_experts", ["8", "64"]) == (8, 64)
  with pytest.raises(app.UsageError, match=r"^error: --scaling_experts=8,x is not a list of "
                                           r"integers; pass e\.g\. 8,64$"):
    sc.parse_ints("scaling_experts", ["8", "x"])


class _Clock:
  """A fake perf_counter / process_time that the timed functions advance."""

  def __init__(self):
    self.now = 0.0

  def perf_counter(self):
    return self.now

  process_time = perf_counter


@pytest.mark.parametrize("after_compile,runs", [(False, {"compiles": 1, "slow": 1}),
                                                (True, {"compiles": 3, "slow": 1})])
def test_slow_variants_are_judged_on_the_first_run_or_after_compile(monkeypatch, after_compile,
                                                                   runs):
  from experiments.benchmarks import lib as bench_lib  # pylint: disable=g-import-not-at-top
  clock = _Clock()
  monkeypatch.setattr(bench_lib, "time", clock)
  calls = {"compiles": 0, "slow": 0}

  def compiles():  # 10 s to compile, then 0.1 s per call
    calls["compiles"] += 1
    clock.now += 10.0 if calls["compiles"] == 1 else 0.1

  def slow():
    calls["slow"] += 1
    clock.now += 10.0

  timed = bench_lib.time_round_robin({"compiles": compiles, "slow": slow}, repeats=3,
                                     slow_s=5.0, slow_repeats=1,
                                     slow_after_compile=after_compile)
  assert {n: t["runs"] for n, t in timed.items()} == runs
  assert {n: c - 1 for n, c in calls.items()} == runs  # plus the untimed first call
  assert timed["slow"]["all_s"] == [10.0]


def test_a_variant_over_once_s_is_timed_by_its_first_run_only(monkeypatch):
  from experiments.benchmarks import lib as bench_lib  # pylint: disable=g-import-not-at-top
  clock = _Clock()
  monkeypatch.setattr(bench_lib, "time", clock)
  calls = {"huge": 0, "fast": 0}

  def huge():
    calls["huge"] += 1
    clock.now += 100.0

  def fast():
    calls["fast"] += 1
    clock.now += 1.0

  timed = bench_lib.time_round_robin({"huge": huge, "fast": fast}, repeats=3, slow_s=5.0,
                                     slow_repeats=2, slow_after_compile=True, once_s=60.0)
  assert list(timed) == ["huge", "fast"] and calls == {"huge": 1, "fast": 4}
  assert timed["huge"]["first_run_only"] and timed["huge"]["all_s"] == [100.0]
  assert timed["huge"]["median_s"] == 100.0 and timed["huge"]["cpu_s"] == 100.0
  assert timed["fast"]["runs"] == 3 and "first_run_only" not in timed["fast"]
