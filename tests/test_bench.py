"""experiments.bench and its suites (experiments/benchmarks/): --suite=layer at a toy size
(every variant, one run), --suite=step and --suite=step --step_twin, the suite registry."""

import json
import pathlib
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks import lib as bench_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow  # imports torch and times both frameworks (~15 s on CI)
def test_layer_suite_times_jax_and_torch_side_by_side(tmp_path):
  pytest.importorskip("transformers")
  out = tmp_path / "layer.json"
  r = subprocess.run(
      [sys.executable, "-m", "experiments.bench", "--suite=layer", "--tokens=64",
       "--d_model=32", "--shapes=coarse", "--repeats=1", "--torch_threads=1",
       "--variants=dense,blocked,torch_dense,hf_mixtral,hf_mixtral_grouped_mm",
       f"--json_out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  shape = json.loads(out.read_text())["shapes"]["coarse"]
  assert shape["torch_threads"] == 1 and shape["torch_skipped"] is None
  rows = shape["variants"]
  assert set(rows) == {"dense", "blocked", "torch_dense", "hf_mixtral", "hf_mixtral_grouped_mm"}
  for name, row in rows.items():
    for mode in ("fwd", "fwdbwd"):
      assert row[mode]["median_s"] > 0 and row[mode]["cpu_s"] >= 0, (name, mode)
  # Each framework's rows are relative to its own dense FFN.
  assert rows["dense"]["fwdbwd"]["ratio_to_dense"] == 1.0
  assert rows["torch_dense"]["fwdbwd"]["ratio_to_torch_dense"] == 1.0
  assert "ratio_to_torch_dense" in rows["hf_mixtral"]["fwdbwd"]
  assert "ratio_to_torch_dense" not in rows["blocked"]["fwdbwd"]
  assert "torch_dense" in r.stdout and "hf_mixtral" in r.stdout
  # Library notices stay out of the table (transformers' ExpertsInterface note on
  # the standalone experts module is printed at its default verbosity).
  assert "ExpertsInterface" not in r.stdout + r.stderr
  # What backend='auto' runs at this shape, and by which rule, is printed and recorded.
  assert shape["auto"]["backend"] == "blocked"
  assert shape["auto"]["rule"] == "blocked at every shape"
  assert f"auto here runs blocked: {shape['auto']['line']}" in " ".join(r.stdout.split())
  # The record says what made it, and renders as docs/benchmarks.md's layer_bench block.
  rec = json.loads(out.read_text())
  assert rec["command"].startswith("python -m experiments.bench --suite=layer")
  assert rec["commit"] and rec["date"] and rec["machine"]
  from experiments import record_blocks  # pylint: disable=g-import-not-at-top
  (tmp_path / "bench").mkdir()
  (tmp_path / "bench" / "layer.json").write_text(out.read_text())
  text = record_blocks.render("<!-- moejax:record bench/layer.json layer_bench -->\n"
                              "<!-- moejax:end record -->\n", str(tmp_path))
  dense = rows["dense"]["fwdbwd"]["median_s"]
  assert (f"| `dense` | {rows['dense']['fwd']['median_s']:.3f} | 1.00 | {dense:.3f} | 1.00 |"
          in text)
  assert f"| `hf_mixtral` |" in text and "auto runs `blocked` here" in text


def test_step_bench_times_each_part_after_its_compiling_run():
  from experiments.benchmarks import step as bench_step  # pylint: disable=g-import-not-at-top
  calls = {"a": 0, "b": 0}

  def count(name):
    def fn():
      calls[name] += 1
      return name
    return fn

  times = bench_step.time_parts({"a": count("a"), "b": count("b")}, repeats=3)
  assert calls == {"a": 4, "b": 4}  # one untimed (compiling) run, then 3 timed
  assert set(times) == {"a", "b"} and set(times["a"]) == {"wall_s", "cpu_s"}
  assert all(t >= 0 for part in times.values() for t in part.values())


def test_step_bench_stops_on_a_failing_part():
  from experiments.benchmarks import step as bench_step  # pylint: disable=g-import-not-at-top

  def broken():
    raise ValueError("no such shape")

  with pytest.raises(RuntimeError, match="parts failed.*broken.*no such shape"):
    bench_step.time_parts({"ok": lambda: 1, "broken": broken}, repeats=1)


@pytest.mark.slow
def test_step_bench_smoke(tmp_path):
  out = tmp_path / "step.json"
  r = subprocess.run([sys.executable, "-m", "experiments.bench", "--suite=step", "--step_scale=s",
                      "--step_repeats=1", f"--json_out={out}"], cwd=ROOT, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  res = json.loads(out.read_text())
  assert res["scale"] == "s" and res["shape"]["d_model"] == 64
  assert res["times"]["attention"]["per_layer"] == res["shape"]["n_layers"] == 2
  assert set(res["times"]) >= {"train step", "rest of the step", "compile train step"}
  assert "| train step |" in r.stdout


def test_the_step_profile_block_says_the_rung_and_each_parts_share():
  from experiments import record_blocks  # pylint: disable=g-import-not-at-top
  from experiments.benchmarks import step  # pylint: disable=g-import-not-at-top
  times = {name: {"wall_s": 0.002, "cpu_s": 0.001} for name in step.ORDER}
  times["train step"] = {"wall_s": 0.08, "cpu_s": 0.04}
  times["attention"] = {"wall_s": 0.02, "cpu_s": 0.01, "per_layer": 2}
  rec = {"suite": "configs/ablations/lossfree.py", "scale": "s", "steps": 300,
         "val_batches": 20, "times": times,
         "shape": {"d_model": 64, "n_layers": 2, "moe_layers": 2, "batch": 16, "seq_len": 64,
                   "params": 460100, "active": 148800, "flops_per_token": 329730.0}}
  text = record_blocks.KINDS["step_profile"](rec)
  assert text.startswith("configs/ablations/lossfree.py at scale s: d=64, 2 layers (2 MoE), "
                         "batch 16 x 64, 0.46M params (0.15M active); 300 steps (307K tokens, "
                         "0.30 TFLOP of training), 20 validation batches\n")
  assert "| train step | 80.0 | 40.0 |  |" in text
  assert "| attention (x2 layers) | 20.0 | 10.0 | 25% |" in text


def _default_experiment(**model):
  from moejax.config import files  # pylint: disable=g-import-not-at-top
  from moejax.train.config import experiment_from_dict  # pylint: disable=g-import-not-at-top
  tree = files.load_config_file(ROOT / "configs" / "default.py").to_dict()
  tree["model"].update(model)
  return experiment_from_dict(tree)


def test_step_twin_pairs_the_default_moe_with_its_active_dense_twin():
  from experiments.benchmarks import twin as bench_twin  # pylint: disable=g-import-not-at-top
  exp = _default_experiment()
  arms = bench_twin.twin_configs(exp)
  assert arms["moe"] is exp
  dense = arms["dense"]
  # configs/default.py: E=16, K=2, f=128 -> one dense FFN of width K*f = 256.
  assert dense.model.moe is None and dense.model.dense_ff_width == 2 * 128
  assert dense.model.dense_twin == "active"
  assert (dense.data, dense.train) == (exp.data, exp.train)
  assert dense.model.d_model == exp.model.d_model and dense.model.n_layers == exp.model.n_layers
  with pytest.raises(ValueError, match="error: --step_twin_config: model.moe is None"):
    bench_twin.twin_configs(dense)


@pytest.mark.slow  # compiles two trainer steps (13-30 s on 2 shared cores even at d=16); the
# config pairing is covered by the test above in the default run
def test_step_twin_times_both_steps_at_a_tiny_size():
  import dataclasses  # pylint: disable=g-import-not-at-top
  from experiments.benchmarks import twin as bench_twin  # pylint: disable=g-import-not-at-top
  exp = _default_experiment(d_model=16, n_layers=1, n_heads=2)
  moe = exp.model.moe
  moe = dataclasses.replace(moe, topology=dataclasses.replace(moe.topology, num_experts=4,
                                                              expert_width=8))
  tree = dataclasses.replace(exp, model=dataclasses.replace(exp.model, moe=moe),
                             data=dataclasses.replace(exp.data, seq_len=16, batch_size=2))
  ex = tree.model.moe.execution
  whole = dataclasses.replace(tree, model=dataclasses.replace(tree.model, moe=dataclasses.replace(
      tree.model.moe, execution=dataclasses.replace(ex, backend="whole_group"))))
  res = bench_twin.twin_suite(tree, repeats=2, matmul_n=32, conditions={},
                              alternatives={"whole_group": whole})
  assert set(res["arms"]) == {"moe", "dense", "moe:whole_group"}
  assert res["tokens_per_step"] == 32
  alt = res["alternatives_over_dense"]["moe:whole_group"]
  assert alt["tokens_per_s"] == pytest.approx(res["arms"]["dense"]["median_s"]
                                              / res["arms"]["moe:whole_group"]["median_s"])
  for r in res["arms"].values():
    assert r["tokens_per_s"] == pytest.approx(32 / r["median_s"]) and len(r["all_s"]) == 2
    assert 0 < r["fraction_of_matmul"]
  q = res["moe_over_dense"]
  assert q["tokens_per_s"] == pytest.approx(res["arms"]["dense"]["median_s"]
                                            / res["arms"]["moe"]["median_s"])
  assert q["spread"]["min"] <= q["spread"]["max"]


def test_step_twin_profile_splits_each_arms_traced_steps_per_step():
  from experiments.benchmarks import profile as bench_profile  # pylint: disable=g-import-not-at-top
  from experiments.benchmarks import twin as bench_twin  # pylint: disable=g-import-not-at-top
  a = jnp.ones((64, 64), jnp.float32)
  mm = jax.jit(lambda a: a @ a)
  sort = jax.jit(lambda a: jnp.sort(a @ a, axis=0))
  jax.block_until_ready((mm(a), sort(a)))  # compiled first, as twin_suite's timing leaves them
  prof = bench_twin.profile_arms({"moe": lambda: sort(a), "dense": lambda: mm(a)}, steps=3)
  assert set(prof) == {"moe", "dense"}
  for r in prof.values():
    assert r["steps"] == 3 and r["traced_s"] > 0
    assert sum(r["wall_ms"].values()) == pytest.approx(r["traced_s"] * 1e3, rel=0.02, abs=0.01)
    assert r["counts"]["matmul"] == 1.0  # three traced steps, one dot each: per step
  assert prof["moe"]["counts"]["sort"] == 1.0 and prof["dense"]["counts"]["sort"] == 0.0
  assert all(v == 0.0 for v in prof["dense"]["excess_x_dense"].values())
  assert set(prof["moe"]["excess_x_dense"]) == set(bench_profile.ROWS)
  md = bench_twin.profile_markdown(prof).splitlines()
  assert md[3] == "| kind | moe ms / dense ms (+excess x dense) |"
  assert any(line.startswith("| sort | ") for line in md)
  assert md[-2].startswith("| traced step | ")


def test_peak_suite_calibrates_once_and_runs_read_it(tmp_path, monkeypatch, capsys):
  from experiments.benchmarks import peak  # pylint: disable=g-import-not-at-top
  from moejax.train import mfu  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(mfu, "CALIBRATE_SECONDS", 0.05)
  res = peak.peak_suite()
  peak.print_peak_table(res)
  printed = capsys.readouterr().out
  assert printed.startswith(f"matmul peak of this machine, cached in {tmp_path}/peak.json")
  cpu = jax.devices()[0]
  key = mfu.calibration_key(cpu, "float32")
  assert f"  {key}: " in printed and set(res["calibrations"]) == {
      key, mfu.calibration_key(cpu, "bfloat16")}
  peak = mfu.resolve_peak(None, dtype="float32")
  assert peak.source == "calibrated:cpu"
  assert peak.per_device == pytest.approx(res["calibrations"][key]["tflops"] * 1e12)


def test_a_failing_variant_is_a_row_and_exit_status_1_naming_it():
  """One binary run (toy size, two variants, one forced to fail): a line per variant as it
  goes, the failed row in the table, and one error line naming it."""
  r = subprocess.run(
      [sys.executable, "-m", "experiments.bench", "--suite=layer", "--tokens=64",
       "--d_model=32", "--shapes=coarse", "--repeats=1", "--variants=dense,blocked",
       "--fail_variants=blocked"], cwd=ROOT, capture_output=True, text=True, timeout=300,
      env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
  out = r.stdout.splitlines()
  assert out[0].startswith("coarse: T=64 d=32 E=8 K=2 f=1024, 4 runs; auto runs ")
  assert out[1].startswith("  execution: T=64 K=2 E=8 d=32 f=1024:")  # the rule, wrapped
  j = next(i for i, line in enumerate(out) if "dense/fwd:" in line)
  assert out[j:j + 2] == ["  dense/fwd: compiled and ran in " + out[j].rsplit(" ", 1)[1],
                          "  dense/fwdbwd: compiled and ran in " + out[j + 1].rsplit(" ", 1)[1]]
  assert out[j + 2] == ("  blocked/fwd: FAILED: RuntimeError: blocked/fwd forced to fail by "
                        "--fail_variants")
  assert max(len(line) for line in out) <= 100, max(out, key=len)   # conditions too
  i = next(i for i, line in enumerate(out) if line.startswith("blocked "))
  assert out[i].split()[1:3] == ["failed", "-"]
  reason = out[i] + "".join(" " + line.strip() for line in out[i + 1:i + 3])  # wrapped under it
  assert "(fwd: RuntimeError: blocked/fwd forced to fail by --fail_variants;" in reason
  assert max(len(line) for line in out[i:i + 3]) <= 100
  assert r.stderr == (
      "error: 2 benchmark run(s) failed: shapes/coarse/variants/blocked/fwd: RuntimeError: "
      "blocked/fwd forced to fail by --fail_variants; shapes/coarse/variants/blocked/fwdbwd: "
      "RuntimeError: blocked/fwdbwd forced to fail by --fail_variants. Fix: see each one's "
      "row above, or pass --keep_going to exit 0 with them in the table\n")


def test_keep_going_exits_0_with_a_note(capsys):
  from experiments import bench  # pylint: disable=g-import-not-at-top
  res = {"shapes": {"fine": {"variants": {"ragged_dot": {"fwd": {"error": "OOM"},
                                                         "fwdbwd": {"refused": "too big"}}}}}}
  bench.finish(res, keep_going=True)
  assert capsys.readouterr().err == (
      "note: 1 benchmark run(s) failed (--keep_going: exit status 0)\n")
  with pytest.raises(SystemExit) as info:
    bench.finish(res, keep_going=False)
  assert info.value.code == 1
  assert capsys.readouterr().err.startswith(
      "error: 1 benchmark run(s) failed: shapes/fine/variants/ragged_dot/fwd: OOM. Fix: ")
  bench.finish({"shapes": {"fine": {"variants": {"dense": {"fwd": {"median_s": 1.0}}}}}},
               keep_going=False)  # every run ran: nothing


def _flag_values(monkeypatch, module, **values):
  """The suite's flags at toy values, in process (absl's flags are not parsed in pytest)."""
  for name, value in values.items():
    monkeypatch.setattr(module, name, types.SimpleNamespace(value=value))


def _forced(monkeypatch, module, name: str, fails):
  """``module.name`` raising when ``fails(*its args)``: a variant that breaks."""
  real = getattr(module, name)

  def wrapper(*args, **kwargs):
    if fails(*args):
      raise RuntimeError("forced to fail")
    return real(*args, **kwargs)
  monkeypatch.setattr(module, name, wrapper)


def test_an_ep_variant_that_fails_is_a_row_and_the_others_still_run(monkeypatch, capsys):
  from experiments.benchmarks import ep  # pylint: disable=g-import-not-at-top
  from experiments.benchmarks import lib as bench_lib  # pylint: disable=g-import-not-at-top
  from moejax.execution import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  _flag_values(monkeypatch, ep, _DEVICES=1, _PER_NODE=1, _LIMIT=1, _EP_CF=1.25, _EP_BATCH=2,
               _EP_SEQ=4, _EP_D=8)
  real_variants = ep._variants

  def two(shape):  # one variant that runs, one whose mesh is forced to fail
    cfg, variants = real_variants(shape)
    return cfg, {n: variants[n] for n in ("ep_capacity", "ep_ragged")}
  monkeypatch.setattr(ep, "_variants", two)
  _forced(monkeypatch, mesh_lib, "make_mesh", lambda pcfg, *_: pcfg.dispatch == "ragged")
  monkeypatch.setattr(bench_lib, "PROGRESS", [sys.stdout])
  shape = ep.run_shape("coarse", repeats=1)
  said = capsys.readouterr().out.splitlines()
  assert said[0].startswith("compiled+ran coarse/ep_capacity in ")
  assert said[1:] == ["coarse/ep_ragged: FAILED: RuntimeError: forced to fail"]
  rows = shape["variants"]
  assert list(rows) == ["single", "ep_capacity", "ep_ragged"]
  assert rows["ep_ragged"] == {"error": "RuntimeError: forced to fail"}
  assert rows["single"]["x_single"] == 1.0 and rows["ep_capacity"]["step_s"] > 0
  res = {"shapes": {"coarse": shape}}
  assert bench_lib.failures(res) == [
      "shapes/coarse/variants/ep_ragged: RuntimeError: forced to fail"]
  table = ep.table_text(res).splitlines()
  assert table[-1] == f"{'ep_ragged':<20}failed: RuntimeError: forced to fail"
  assert table[3] == f"{'single':<20}{rows['single']['step_s']:>7.3f}{1.0:>9.2f}"


def test_a_serving_variant_that_fails_is_a_row_and_the_others_still_run(monkeypatch, capsys):
  from experiments.benchmarks import lib as bench_lib  # pylint: disable=g-import-not-at-top
  from experiments.benchmarks import serving  # pylint: disable=g-import-not-at-top
  _flag_values(monkeypatch, serving, _BATCHES=["1"], _PROMPT=4, _STEPS=2, _PREFILL_REPEATS=1,
               _FFN_REPEATS=1, _D=16, _LAYERS=1, _HEADS=2, _EXPERTS=4, _TOP_K=2, _WIDTH=8,
               _BACKEND="blocked", _MODELS=["moe", "dense_total"], _PLOT=None, _SEED=0)

  class Broken(serving.Decoder):
    def extend(self, *args, **kwargs):
      raise RuntimeError("forced to fail")
  # The dense_total model's decoder, and the gather path of the MoE's FFN slot, raise.
  real = serving.Decoder
  monkeypatch.setattr(serving, "Decoder", lambda model: (real if model.cfg.moe else Broken)(model))
  _forced(monkeypatch, serving, "_gather_moe", lambda *_: True)
  monkeypatch.setattr(bench_lib, "PROGRESS", [sys.stdout])
  res = serving.serving_suite({"platform": "cpu"})
  assert capsys.readouterr().out.splitlines() == [
      "timing prefill and decode at batch 1: moe, dense_total",
      "batch 1/dense_total: FAILED: RuntimeError: forced to fail",
      "batch 1/ffn moe_gather: FAILED: RuntimeError: forced to fail"]
  assert res["results"]["dense_total"][1] == {"error": "RuntimeError: forced to fail"}
  assert res["results"]["moe"][1]["decode_p50_s"] > 0
  assert res["ffn_slot_s"][1]["moe_gather"] == {"error": "RuntimeError: forced to fail"}
  assert res["ffn_slot_s"][1]["moe_blocked"] > 0 and res["ffn_slot_s"][1]["dense_total"] > 0
  assert bench_lib.failures(res) == [
      "results/dense_total/1: RuntimeError: forced to fail",
      "ffn_slot_s/1/moe_gather: RuntimeError: forced to fail"]
  serving.print_serving_table(res)
  printed = capsys.readouterr().out.splitlines()
  assert f"{1:>4} {'dense_total':<13}failed: RuntimeError: forced to fail" in printed
  assert "| 1 | dense_total | failed: RuntimeError: forced to fail | | | | | |" in printed


def test_ragged_dot_beyond_the_machines_memory_is_refused_in_one_line_before_running():
  from experiments.benchmarks import lib as bench_lib  # pylint: disable=g-import-not-at-top
  lhs, rhs = jnp.ones((256, 16)), jnp.ones((4, 16, 8))
  sizes = jnp.full((4,), 64, jnp.int32)
  fn = jax.jit(jax.lax.ragged_dot)
  small = bench_lib.memory_checked(fn, (lhs, rhs, sizes), "ragged_dot/fwd",
                                   available=lambda: 2**10)  # a 1 KiB machine
  fits = bench_lib.memory_checked(fn, (lhs, rhs, sizes), "ragged_dot/fwd",
                                  available=lambda: 2**40)
  timed = bench_lib.time_round_robin({"ragged_dot/fwd": small, "ok/fwd": fits}, repeats=1)
  assert list(timed["ragged_dot/fwd"]) == ["refused"]
  # The dense fallback's [G, M, K] copy of the rows alone: 4 x 256 x 16 floats, 64 KiB.
  assert re.fullmatch(r"ragged_dot/fwd needs (\d+\.\d) KiB here, more than the 1\.0 KiB "
                      r"available; not run", timed["ragged_dot/fwd"]["refused"])
  assert float(timed["ragged_dot/fwd"]["refused"].split()[2]) >= 64
  assert timed["ok/fwd"]["median_s"] > 0
  assert bench_lib.failures({"variants": timed}) == []  # refused is not a failure


def test_every_suite_module_registers_its_suite_and_the_flag_lists_them():
  from experiments import bench  # pylint: disable=g-import-not-at-top
  from experiments.benchmarks import registry  # pylint: disable=g-import-not-at-top
  suites = registry.load_all()
  assert list(suites) == list(registry.MODULES)  # each module registers one suite, its name
  assert bench.flags.FLAGS["suite"].parser.enum_values == list(registry.MODULES)
  assert registry.get("gmm").name == "gmm"
  with pytest.raises(ValueError, match="error: benchmark suite 'gmm' is registered twice"):
    registry.register(registry.Suite("gmm", "another", lambda: {}, print))
  with pytest.raises(KeyError, match="--suite='nope' is not a benchmark suite"):
    registry.get("nope")


def test_layer_table_rows_fit_100_columns(capsys):
  """Skipped backends, a failed row and the torch note continue on indented lines."""
  from experiments.benchmarks import layer  # pylint: disable=g-import-not-at-top
  tpu = ("gmm backend 'pallas_tpu': needs a TPU (Pallas Mosaic TPU kernels); this platform is "
         "'cpu' (interpret mode is not a performance path)")
  gpu = ("gmm backend 'pallas_gpu': needs an NVIDIA Hopper GPU (Pallas Mosaic GPU: TMA + "
         "wgmma); this platform is 'cpu' (interpret mode is not a performance path)")
  torch_note = ("torch/transformers not installed (No module named 'transformers'); pip install "
                "-e .[interop]")
  error = "RuntimeError: " + " ".join(["out of memory"] * 12)
  shape = {"T": 64, "d": 32, "E": 8, "K": 2, "f": 1024, "dense_width": 2048, "fwd_gflop": 0.0,
           "auto": {"backend": "blocked", "line": "execution: T=64 K=2 E=8 d=32 f=1024: 16 rows "
                                                  "per expert -> blocked (rule: blocked at every "
                                                  "shape)"},
           "variants": {"dense": {"fwd": {"median_s": 0.001, "ratio_to_dense": 1.0, "runs": 1}},
                        "blocked": {"fwd": {"error": error}, "fwdbwd": {"refused": "too big"}}},
           "skipped": {"pallas_tpu": tpu, "pallas_gpu": gpu}, "torch_skipped": torch_note}
  layer.print_layer_table({"shapes": {"coarse": shape}})
  lines = capsys.readouterr().out.splitlines()
  assert max(len(line) for line in lines) <= 100, max(lines, key=len)
  i = lines.index("pallas_tpu            skipped: needs a TPU (Pallas Mosaic TPU kernels); this "
                  "platform is 'cpu'")
  assert lines[i + 1] == " " * 31 + "(interpret mode is not a performance path)"
  assert lines[i + 2].startswith("pallas_gpu            skipped: needs an NVIDIA Hopper GPU")
  text = " ".join(" ".join(lines).split())
  assert "torch variants skipped: " + torch_note in text
  assert "auto here runs blocked: " + shape["auto"]["line"] in text
  assert f"(fwd: {error}; fwdbwd: too big)" in text
  row = next(line for line in lines if line.startswith("blocked "))
  assert row.split()[1:6] == ["failed", "-", "refused", "-", "-"]


def test_layer_variants_are_the_backends_that_run_here_and_the_baselines():
  from experiments.benchmarks import layer  # pylint: disable=g-import-not-at-top
  v = layer.jax_variants(["blocked", "ragged_dot", "pallas_x"], {"tile_m": 64}, 1.5, 128)
  assert list(v) == ["dense", "expert_matmuls", "blocked", "blocked_unfused", "blocked_folded",
                     "pallas_x",
                     "gshard", "ragged_dot"]
  assert v["blocked"] == {"backend": "blocked", "tile_m": 64}
  assert v["blocked_unfused"] == {"backend": "blocked", "fused": False, "fold_permute": False,
                                  "tile_m": 64}
  assert v["gshard"] == {"capacity_factor": 1.5, "group": 128}
  assert list(layer.jax_variants(["ragged_dot"], {}, 1.25, 8)) == [
      "dense", "expert_matmuls", "gshard", "ragged_dot"]


def test_expert_matmuls_is_each_experts_ffn_on_an_equal_share_of_rows():
  """The layer suite's matmul-only baseline: expert e's rows are tokens e*C .. e*C+C-1
  (mod T), C = ceil(T K / E), each through expert e's SwiGLU FFN."""
  prob = bench_lib.layer_problem(6, 4, 4, 2, 3, seed=0)
  x, p = prob["x"], prob["moe"]
  xe = bench_lib.expert_rows(x, 4, 2)
  assert xe.shape == (4, 3, 4)
  np.testing.assert_array_equal(xe[1, 0], x[3])
  np.testing.assert_array_equal(xe[3, 2], x[(3 * 3 + 2) % 6])
  got = bench_lib.expert_matmuls(p, xe)
  for e in range(4):
    a, b = np.split(np.asarray(xe[e] @ p["w_gate_up"][e]), 2, axis=-1)
    want = (a / (1 + np.exp(-a)) * b) @ np.asarray(p["w_down"][e])
    np.testing.assert_allclose(got[e], want, rtol=1e-5, atol=1e-6)


def test_a_records_command_carries_the_glibc_tunables_it_ran_under(monkeypatch):
  from experiments import bench  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  plain = bench.record_provenance()["command"]
  assert "GLIBC_TUNABLES" not in plain
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
  assert bench.record_provenance()["command"] == f"GLIBC_TUNABLES=glibc.malloc.hugetlb=1 {plain}"
