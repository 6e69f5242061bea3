"""experiments.benchmarks.profile: the instruction classifier, the accounting, the spec's
errors, a tiny run."""

import json

import pytest

from experiments.benchmarks import profile as bp

E = bp.Event


@pytest.mark.parametrize("name, ops, kind", [
    ("ynn_fusion.12", ["ynn"], "matmul"),
    ("dot_general.533", ["dot", "general"], "matmul"),
    ("dot.3", ["dot"], "matmul"),
    ("wrapped_broadcast.6", ["broadcast"], "fill"),
    ("wrapped_iota", ["iota"], "fill"),
    ("broadcast_select_fusion", ["broadcast", "select"], "elementwise"),
    ("dynamic-slice_bitcast_fusion.3", ["dynamic-slice", "bitcast"], "slice/concat copy"),
    ("concatenate.220", ["concatenate"], "slice/concat copy"),
    ("copy.168", ["copy"], "slice/concat copy"),
    ("bitcast_dynamic-update-slice_fusion", ["bitcast", "dynamic-update-slice"],
     "in-place write"),
    ("select_dynamic-update-slice_fusion.1", ["select", "dynamic-update-slice"],
     "in-place write"),
    ("bitcast_gather_fusion.2", ["bitcast", "gather"], "gather"),
    ("wrapped_scatter.4", ["scatter"], "scatter"),
    ("sort.2", ["sort"], "sort"),
    ("add_divide_fusion", ["add", "divide"], "elementwise"),
    ("slice_multiply_fusion.7", ["slice", "multiply"], "elementwise"),
    ("fusion.3", [], "elementwise"),
])
def test_instruction_names_map_to_their_operations_and_kind(name, ops, kind):
  assert bp.op_names(name) == ops
  assert bp.op_kind(name) == kind


@pytest.mark.parametrize("name, is_op", [
    ("ynn_fusion.3", True), ("copy.5", True), ("while.87", False), ("while", False),
    ("conditional.2", False), ("ThunkExecutor::Execute", False),
    ("ThreadpoolListener::StartRegion", False), ("end: ynn_fusion", False),
    ("SlinkyThreadPool::Await", False), ("fusion", False),
])
def test_only_instruction_events_are_counted(name, is_op):
  assert bp.is_instruction(name) is is_op


def test_summarize_sums_kinds_and_unions_each_threads_busy_time():
  ms = 1e6  # ns
  events = [
      E("a", "ThunkExecutor::Execute", 0, 10 * ms),       # a container: not counted
      E("a", "ynn_fusion.1", 0, 4 * ms),
      E("a", "wrapped_broadcast", 4 * ms, 2 * ms),
      E("a", "end: ynn_fusion.1", 4 * ms, 0),
      E("b", "ThreadpoolListener::StartRegion", 1 * ms, 0),  # b helps a's matmul: 1..3 ms
      E("b", "ThreadpoolListener::StopRegion", 3 * ms, 0),
      E("b", "ynn_fusion.2", 2 * ms, 3 * ms),               # overlaps the region: 1..5 ms
      E("b", "while.4", 0, 9 * ms),
      E("b", "ThreadpoolListener::StartRegion", 6 * ms, 0),  # pool work after every
      E("b", "ThreadpoolListener::StopRegion", 8 * ms, 0),   # instruction ended: 6..8
  ]
  s = bp.summarize(events, wall_s=0.010, cores=2)
  assert s["kinds_ms"]["matmul"] == 7.0 and s["kinds_ms"]["fill"] == 2.0
  assert s["counts"]["matmul"] == 2 and s["counts"]["fill"] == 1
  assert sum(s["counts"].values()) == 3
  assert s["ops_ms"] == 9.0
  assert s["threads"] == 2
  assert s["busy_ms"] == 6.0 + 6.0  # a: 0..6; b: the union of 1..3, 2..5 and 6..8
  assert s["utilization"] == 0.6    # 12 busy ms over 2 cores x 10 ms
  assert [o["name"] for o in s["top"]] == ["ynn_fusion.1", "ynn_fusion.2", "wrapped_broadcast"]
  # Wall time: 0-2 a's matmul alone, 2-4 both matmuls (1 ms each), 4-5 the
  # fill beside b's matmul (0.5 each), 5-6 the fill alone, 6-8 only b's
  # pool region, 8-10 nothing runs.
  assert s["wall_ms"]["matmul"] == 4.5 and s["wall_ms"]["fill"] == 1.5
  assert s["wall_ms"][bp.POOL] == 2.0 and s["wall_ms"][bp.IDLE] == 2.0
  assert sum(s["wall_ms"].values()) == pytest.approx(10.0)


def test_wall_shares_split_each_instant_among_the_running_instructions():
  shares, covered = bp.wall_shares([(0, 6, "matmul"), (3, 6, "fill"), (3, 6, "fill"),
                                    (8, 9, "sort"), (9, 9, "copy")])
  assert covered == 7  # 0-6 and 8-9; the empty interval adds nothing
  assert shares == {"matmul": 3 + 1, "fill": 2, "sort": 1}


def test_points_parse_and_a_bad_one_is_named():
  assert bp.parse_points(["8192x64", " 2048 x 8 "]) == ((8192, 64), (2048, 8))
  for bad in ("8192", "8192x", "x64", "0x8", "8192x64x2", "a x b"):
    with pytest.raises(ValueError, match=r"--profile_points: .* e\.g\. 8192x64"):
      bp.parse_points([bad])
  with pytest.raises(ValueError, match="empty"):
    bp.parse_points([])


def test_spec_rejects_unknown_variants_and_too_few_experts_before_any_compute():
  with pytest.raises(ValueError, match=r"--profile_variants: unknown \['fast'\]"):
    bp.ProfileSpec(points=((64, 4),), variants=("dense", "fast"))
  with pytest.raises(ValueError, match=r"64x4 has E=4 < K=8"):
    bp.ProfileSpec(points=((64, 4),))
  with pytest.raises(ValueError, match="repeats=0"):
    bp.ProfileSpec(points=((64, 4),), k=2, repeats=0)


def test_profile_suite_tiny_run_traces_every_variant_and_attributes_its_time():
  spec = bp.ProfileSpec(points=((64, 4),), k=2, f=8, d=16, repeats=1)
  res = json.loads(json.dumps(bp.profile_suite(spec, {"platform": "cpu"})))
  (pt,) = res["points"]
  assert (pt["T"], pt["E"]) == (64, 4) and set(pt["variants"]) == {"dense", "blocked"}
  dense, moe = pt["variants"]["dense"], pt["variants"]["blocked"]
  for r in (dense, moe):
    assert set(r["kinds_ms"]) == set(bp.KINDS)
    assert r["counts"]["matmul"] >= 3 and r["kinds_ms"]["matmul"] > 0
    assert r["ops_ms"] == pytest.approx(sum(r["kinds_ms"].values()), abs=1e-2)
    assert 0 < r["utilization"] and r["traced_s"] > 0 and r["median_s"] > 0
    assert r["fresh_mib"] >= 0
  # The routed layer sorts its token copies, the dense FFN does not. (Which
  # fusion a scatter or a slice lands in depends on the XLA flags: the test
  # run's loop emitters name them differently, so they are not asserted.)
  assert dense["counts"]["sort"] == 0 and dense["counts"]["scatter"] == 0
  assert moe["counts"]["sort"] >= 1
  assert dense["x_dense"] == 1.0 and moe["x_dense"] > 0
  assert set(moe["excess_x_dense"]) == set(bp.ROWS)
  for r in (dense, moe):  # the wall split adds up to the traced call
    assert sum(r["wall_ms"].values()) == pytest.approx(r["traced_s"] * 1e3, rel=0.02, abs=0.01)
  assert sum(moe["excess_x_dense"].values()) == pytest.approx(
      moe["traced_s"] / dense["traced_s"] - 1, rel=0.02, abs=0.02)
  assert all(v == 0.0 for v in dense["excess_x_dense"].values())


def test_markdown_table_cells_come_from_the_wall_split():
  def variant(wall, traced, x, util):
    return {"wall_ms": dict.fromkeys(bp.ROWS, 0.0) | wall, "traced_s": traced,
            "x_dense": x, "cpu_x_dense": x, "utilization": util,
            "excess_x_dense": {k: (wall.get(k, 0.0) - dense_wall.get(k, 0.0)) / 1000.0
                               for k in bp.ROWS}}
  dense_wall = {"matmul": 800.0, bp.POOL: 150.0, bp.IDLE: 50.0}
  res = {"points": [{"T": 64, "E": 8, "variants": {
      "dense": variant(dense_wall, 1.0, 1.0, 1.1),
      "blocked": variant({"matmul": 900.0, "fill": 100.0, bp.POOL: 100.0, bp.IDLE: 100.0},
                         1.2, 1.19, 0.9)}},
      {"T": 64, "E": 512, "variants": {"dense": variant(dense_wall, 1.0, 1.0, 1.1),
                                       "blocked": {"error": "OOM"}}}]}
  md = bp.markdown_tables(res).splitlines()
  assert md[0] == "| kind (wall ms: blocked / dense (+excess x dense)) | T=64 E=8 |"
  assert "| matmul | 900 / 800 (+0.100) |" in md
  assert "| fill | 100 / 0 (+0.100) |" in md
  assert f"| {bp.POOL} | 100 / 150 (-0.050) |" in md
  assert "| traced call | 1200 / 1000 (+0.200) |" in md
  assert "| untraced wall x dense | 1.19 |" in md
  assert "| utilization (busy / cores x wall) | 0.90 / 1.10 |" in md
  assert len(md) == 2 + len(bp.ROWS) + 4  # the failed point has no column


def test_fresh_mib_counts_the_pages_a_fresh_output_faults_in():
  jax = pytest.importorskip("jax")
  jnp = jax.numpy
  n = 16 * 2**20  # 64 MiB of float32: above glibc's mmap threshold, a fresh mapping per call
  fill = jax.jit(lambda v: jnp.full((n,), v, jnp.float32))
  small = jax.jit(lambda v: jnp.full((16,), v, jnp.float32))
  fill(1.0).block_until_ready()
  small(1.0).block_until_ready()
  assert 56 <= bp.fresh_mib(lambda: fill(1.0)) <= 72
  assert bp.fresh_mib(lambda: small(1.0)) < 8


def test_markdown_table_shows_instructions_and_fresh_pages_when_every_cell_has_them():
  def variant(fresh):
    return {"wall_ms": dict.fromkeys(bp.ROWS, 0.0), "traced_s": 1.0, "x_dense": 1.0,
            "cpu_x_dense": 1.0, "utilization": 1.0, "fresh_mib": fresh,
            "counts": dict.fromkeys(bp.KINDS, 0) | {"matmul": 2, "elementwise": int(fresh)},
            "excess_x_dense": dict.fromkeys(bp.ROWS, 0.0)}
  res = {"points": [{"T": 64, "E": 8, "variants": {"dense": variant(12.4),
                                                   "blocked": variant(915.2)}}]}
  md = bp.markdown_tables(res)
  assert "| fresh MiB per call (pages faulted in) | 915 / 12 |" in md
  assert "| instructions run (elementwise) | 917 (915) / 14 (12) |" in md
  for key in ("fresh_mib", "counts"):  # an older record: no row
    del res["points"][0]["variants"]["dense"][key]
  assert "fresh MiB" not in bp.markdown_tables(res)
  assert "instructions run" not in bp.markdown_tables(res)
