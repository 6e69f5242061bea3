r"""Profile suite (``--suite=profile``): where a layer's time goes, by kind of work.

Usage:
  python -m experiments.bench --suite=profile --json_out=/tmp/profile.json
  python -m experiments.bench --suite=profile --profile_points=8192x512 \
      --profile_variants=dense,blocked --repeats=3
  python -m experiments.bench --suite=profile --profile_points=64x4 --profile_k=2 \
      --profile_f=16 --profile_d_model=32 --repeats=1    # a smoke run: seconds

Legend: T tokens, d model width, E experts, K slots per token, f expert
hidden width.

The scaling suite says *how much* slower the MoE layer is than the dense FFN
of equal active FLOPs; this suite says *where*. At each point ``TxE`` (K, f,
d as in the scaling suite: 8, 256, 512) it builds the same problem and
variants (``bench_lib.layer_problem`` / ``jax_layer_fns``: ``dense`` and
``blocked``, the fused default, or any of the scaling suite's JAX variants),
times them untraced (round-robin, medians of ``--repeats``, the wall and
process CPU time), then runs each once more under ``jax.profiler.trace``
with host tracing at level 3, which records every XLA:CPU thunk (every HLO
instruction that runs, inside loops too) with its start and duration on
the thread that ran it.

Each instruction is sorted into a kind by its HLO name (:func:`op_kind`;
XLA names a fusion after the operations in it): matmul (the YNNPACK dot
fusions and plain dots), fill (broadcasts and iotas: zero-filled buffers,
which on this CPU mostly measure the page faults of fresh memory),
slice/concat copy (dynamic slices, concatenates, copies: an expert's
weights copied out of the [E, ...] stack before a dot reads them), in-place
write (dynamic-update-slice: a gradient slice or a saved tile written into a
loop carry), gather, scatter, sort, and elementwise (every other fusion).

What the numbers are: an instruction's duration is measured on the thread
that ran it, and includes the time other threads spent helping it (an
intra-op parallel matmul); instructions with no data dependence also run
concurrently on different threads (the dense FFN's dx and dW matmuls do), so
per-kind sums of durations (``thread ms``, in the JSON) overlap and cannot
be compared between variants. The table therefore splits the traced call's
*wall* time: at every instant the instructions running (on any thread) share
it equally. XLA:CPU runs a large matmul's thunk asynchronously: its event
can end while the thread pool still works on it, so time when no
instruction runs but some thread is inside a thread-pool work region is
``pool work only`` (mostly the tail of a parallel matmul), and time when
neither runs is ``no instruction`` (the executor between thunks, loop
control, waiting). The rows add up to the traced wall time, and ``+v`` =
(variant's wall ms of a kind - dense's) / dense's traced wall: the rows of
``+v`` add up to the traced wall ratio minus 1, so each says how much of
the MoE's distance from the dense FFN that kind of work takes. ``busy`` (per thread, the union of its instructions and its
thread-pool work regions) over ``cores x wall`` is how much of the machine a
variant kept working (above 1: more threads than cores).

``instructions run`` counts the thunks of the traced call, the elementwise
ones in parentheses: XLA:CPU runs each fusion as its own thunk with a fixed
cost of microseconds, which a loop over small tiles pays on every tile.
``fresh MiB per call`` counts the pages the process faulted in during one
untraced call (minor page faults times the page size, the median of three
calls): XLA:CPU allocates a call's outputs and large temporaries afresh, and
the operating system maps and zeroes each new page on first touch, so a fill
or write of a fresh buffer runs at the first-touch rate the scaling suite
measures, not at copy bandwidth. The expert weights' gradients are written
fresh on every call, so this grows with E * d * f, not with the FLOPs.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import resource
import statistics
import tempfile
import time
from typing import Optional

import jax
from absl import app, flags

from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import scaling as bench_scaling
from experiments.benchmarks import common, registry

_POINTS = flags.DEFINE_list("profile_points", ["8192x8", "8192x64", "8192x512", "2048x64"],
                            "points to profile, each TxE (tokens x experts)")
_K = flags.DEFINE_integer("profile_k", 8, "K, slots per token")
_F = flags.DEFINE_integer("profile_f", 256, "f, expert hidden width (dense width K*f)")
_D = flags.DEFINE_integer("profile_d_model", 512, "d, model width")
_VARIANTS = flags.DEFINE_list("profile_variants", ["dense", "blocked"],
                              "JAX variants to profile (the scaling suite's names); "
                              "dense is always included, it is the base")
_MODE = flags.DEFINE_enum("profile_mode", "fwdbwd", ["fwdbwd", "fwd"],
                          "profile forward+backward or the forward alone")
_KEEP = flags.DEFINE_string("profile_trace_dir", None,
                            "keep the traces here (TensorBoard / xprof can open them); "
                            "default: a temporary directory, removed")

# A kind is the first rule one of the instruction's operation names matches;
# names made only of these are a fill, everything else is elementwise.
KIND_RULES = (("matmul", {"ynn", "dot", "convolution"}),
              ("sort", {"sort"}),
              ("scatter", {"scatter"}),
              ("gather", {"gather"}),
              ("slice/concat copy", {"dynamic-slice", "concatenate", "copy", "transpose"}),
              ("in-place write", {"dynamic-update-slice"}))
FILL_OPS = {"broadcast", "iota", "constant", "bitcast"}
KINDS = tuple(k for k, _ in KIND_RULES) + ("fill", "elementwise")
POOL = "pool work only"
IDLE = "no instruction"
ROWS = KINDS + (POOL, IDLE)  # the wall split's rows, in table order
# Events that contain instructions (or mark thread-pool work), not instructions.
_CONTAINERS = {"while", "conditional", "call"}
_HLO_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")


def op_names(hlo_name: str) -> list[str]:
  """The operations an HLO instruction's name lists: 'bitcast_gather_fusion.3'
  -> ['bitcast', 'gather'], 'wrapped_broadcast' -> ['broadcast'],
  'ynn_fusion.12' -> ['ynn'], 'dot_general.5' -> ['dot', 'general']."""
  base = re.sub(r"(\.\d+)+$", "", hlo_name)
  base = re.sub(r"^wrapped_", "", base)
  base = re.sub(r"_?fusion$", "", base)
  return [p for p in base.split("_") if p]


def op_kind(hlo_name: str) -> str:
  """The kind of work an XLA:CPU instruction does, from its name (see KIND_RULES)."""
  ops = op_names(hlo_name)
  for kind, names in KIND_RULES:
    if any(o in names for o in ops):
      return kind
  if ops and set(ops) <= FILL_OPS:
    return "fill"
  return "elementwise"


def is_instruction(name: str) -> bool:
  """True for an HLO instruction's event (not the executor, a loop, a marker)."""
  return bool(_HLO_NAME.match(name)) and op_names(name)[:1] != [] and \
      re.sub(r"(\.\d+)+$", "", name) not in _CONTAINERS


@dataclasses.dataclass(frozen=True)
class Event:
  thread: str
  name: str
  start_ns: float
  dur_ns: float


def _union_ns(intervals) -> float:
  total, end = 0.0, float("-inf")
  for s, e in sorted(intervals):
    if e > end:
      total += e - max(s, end)
      end = e
  return total


def wall_shares(intervals: list[tuple[float, float, str]]) -> tuple[dict, float]:
  """({kind: ns}, covered ns): the time of the intervals (start, end, kind),
  each instant shared equally among the intervals running then; covered is
  the time at least one runs."""
  bounds = sorted({b for s, e, _ in intervals for b in (s, e)})
  where = {b: i for i, b in enumerate(bounds)}
  delta = collections.defaultdict(collections.Counter)  # segment -> kind -> +-1
  for s, e, kind in intervals:
    if e > s:
      delta[where[s]][kind] += 1
      delta[where[e]][kind] -= 1
  shares, running, covered = collections.Counter(), collections.Counter(), 0.0
  for i in range(len(bounds) - 1):
    running.update(delta[i])  # Counter.update adds, negatives included
    n = sum(running.values())
    if n:
      dt = bounds[i + 1] - bounds[i]
      covered += dt
      for kind, c in running.items():
        if c:
          shares[kind] += dt * c / n
  return dict(shares), covered


def summarize(events: list[Event], wall_s: float, cores: int, top: int = 8) -> dict:
  """The call's wall time split by kind (``wall_ms``, with ``no instruction``),
  per-kind thread time and counts, per-thread busy time, the top instructions.

  Busy time of a thread: the union of its instructions and of its
  thread-pool work regions (``ThreadpoolListener::StartRegion`` ..
  ``StopRegion``: a worker helping an intra-op parallel instruction).
  """
  kinds = {k: 0.0 for k in KINDS}
  counts = collections.Counter()
  per_op = collections.Counter()
  spans = collections.defaultdict(list)
  ops = []
  region_start = {}
  for ev in sorted(events, key=lambda e: e.start_ns):
    if ev.name == "ThreadpoolListener::StartRegion":
      region_start[ev.thread] = ev.start_ns
    elif ev.name == "ThreadpoolListener::StopRegion" and ev.thread in region_start:
      spans[ev.thread].append((region_start.pop(ev.thread), ev.start_ns))
    elif is_instruction(ev.name):
      kind = op_kind(ev.name)
      kinds[kind] += ev.dur_ns / 1e6
      counts[kind] += 1
      per_op[ev.name] += ev.dur_ns / 1e6
      spans[ev.thread].append((ev.start_ns, ev.start_ns + ev.dur_ns))
      ops.append((ev.start_ns, ev.start_ns + ev.dur_ns, kind))
  busy = {t: _union_ns(s) / 1e6 for t, s in spans.items()}
  shares, covered = wall_shares(ops)
  either = _union_ns([iv for t in spans for iv in spans[t]])  # instructions and pool regions
  wall = {k: round(shares.get(k, 0.0) / 1e6, 3) for k in KINDS}
  wall[POOL] = round((either - covered) / 1e6, 3)
  wall[IDLE] = round(max(wall_s * 1e3 - either / 1e6, 0.0), 3)
  return {"wall_ms": wall,
          "kinds_ms": {k: round(v, 3) for k, v in kinds.items()},
          "counts": {k: counts[k] for k in KINDS},
          "ops_ms": round(sum(kinds.values()), 3),
          "busy_ms": round(sum(busy.values()), 3),
          "threads": len(busy),
          "utilization": round(sum(busy.values()) / (wall_s * 1e3 * cores), 3),
          "top": [{"name": n, "kind": op_kind(n), "ms": round(ms, 3)}
                  for n, ms in per_op.most_common(top)]}


def read_trace(trace_dir: str) -> list[Event]:
  """The host thread events of the one trace under ``trace_dir`` (Python's line excluded)."""
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if len(paths) != 1:
    raise RuntimeError(f"expected one .xplane.pb under {trace_dir}, found {len(paths)}")
  plane = jax.profiler.ProfileData.from_file(paths[0]).find_plane_with_name("/host:CPU")
  if plane is None:
    raise RuntimeError(f"{paths[0]}: no /host:CPU plane (was host tracing on?)")
  return [Event(line.name, ev.name, ev.start_ns, ev.duration_ns)
          for line in plane.lines if line.name != "python" for ev in line.events]


def trace_once(fn, trace_dir: str) -> tuple[float, list[Event]]:
  """(wall seconds, events) of one traced call of ``fn`` (compiled already)."""
  opts = jax.profiler.ProfileOptions()
  opts.host_tracer_level = 3  # every thunk, not only the expensive ones
  opts.python_tracer_level = 0
  with jax.profiler.trace(trace_dir, profiler_options=opts):
    t0 = time.perf_counter()
    bench_lib.block(fn())
    wall = time.perf_counter() - t0
  return wall, read_trace(trace_dir)


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
  """What to profile; built by :func:`spec_from_flags`, checked before any compute."""
  points: tuple[tuple[int, int], ...]  # (T, E)
  k: int = 8
  f: int = 256
  d: int = 512
  variants: tuple[str, ...] = ("dense", "blocked")
  mode: str = "fwdbwd"
  repeats: int = 3
  seed: int = 0
  trace_dir: Optional[str] = None

  def __post_init__(self):
    for name in ("k", "f", "d", "repeats"):
      if getattr(self, name) < 1:
        raise ValueError(f"profile {name}={getattr(self, name)}: must be >= 1")
    unknown = [v for v in self.variants if v not in bench_scaling.JAX_VARIANTS]
    if unknown:
      raise ValueError(f"--profile_variants: unknown {unknown}; use some of "
                       f"{sorted(bench_scaling.JAX_VARIANTS)}")
    for t, e in self.points:
      if e < self.k:
        raise ValueError(f"--profile_points: {t}x{e} has E={e} < K={self.k}; "
                         f"give E >= K or lower --profile_k")


def parse_points(values) -> tuple[tuple[int, int], ...]:
  """['8192x64', ...] -> ((8192, 64), ...), with an error naming a bad entry."""
  out = []
  for v in values:
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(v))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
      raise ValueError(f"--profile_points: {v!r} is not TxE with positive integers, "
                       f"e.g. 8192x64")
    out.append((int(m.group(1)), int(m.group(2))))
  if not out:
    raise ValueError("--profile_points: empty; give at least one TxE, e.g. 8192x64")
  return tuple(out)


def spec_from_flags(repeats: int, seed: int) -> ProfileSpec:
  variants = ("dense",) + tuple(v for v in _VARIANTS.value if v != "dense")
  return ProfileSpec(parse_points(_POINTS.value), _K.value, _F.value, _D.value, variants,
                     _MODE.value, repeats, seed, _KEEP.value)


def fresh_mib(fn, calls: int = 3) -> float:
  """MiB of pages the process faulted in per call of ``fn`` (compiled already),
  the median of ``calls`` calls."""
  per = []
  for _ in range(calls):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bench_lib.block(fn())
    per.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  return round(statistics.median(per) * resource.getpagesize() / 2**20, 1)


def profile_point(spec: ProfileSpec, t: int, e: int, root: str) -> dict:
  prob = bench_lib.layer_problem(t, spec.d, e, spec.k, spec.f, seed=spec.seed)
  fns = bench_lib.jax_layer_fns(prob, {v: bench_scaling.JAX_VARIANTS[v] for v in spec.variants})
  fns = {v: fns[f"{v}/{spec.mode}"] for v in spec.variants}
  timed = bench_lib.time_round_robin(fns, spec.repeats)
  cores = len(os.sched_getaffinity(0))
  out = {"T": t, "E": e, "variants": {}}
  for v, fn in fns.items():
    if "error" in timed[v]:
      out["variants"][v] = {"error": timed[v]["error"]}
      continue
    wall, events = trace_once(fn, os.path.join(root, f"T{t}_E{e}_{v}"))
    out["variants"][v] = {"median_s": timed[v]["median_s"], "cpu_s": timed[v]["cpu_s"],
                          "traced_s": round(wall, 6), "fresh_mib": fresh_mib(fn),
                          **summarize(events, wall, cores)}
  base = out["variants"].get("dense", {})
  for v, r in out["variants"].items():
    if "error" in r or "error" in base:
      continue
    r["x_dense"] = round(r["median_s"] / base["median_s"], 3)
    r["cpu_x_dense"] = round(r["cpu_s"] / base["cpu_s"], 3)
    r["excess_x_dense"] = {k: round(v, 3) for k, v in excess_x_dense(r, base).items()}
  return out


def excess_x_dense(r: dict, base: dict) -> dict:
  """{row: (r's wall ms of that row - base's) / base's traced ms}: the rows add
  up to r's traced time over base's, minus 1."""
  return {k: (r["wall_ms"][k] - base["wall_ms"][k]) / (base["traced_s"] * 1e3) for k in ROWS}


def wall_cell(r: dict, base: dict, k: str, fmt: str = ".0f") -> str:
  """'r ms / base ms (+excess)' of row k, the cell of the markdown tables."""
  return (f"{r['wall_ms'][k]:{fmt}} / {base['wall_ms'][k]:{fmt}} "
          f"({r['excess_x_dense'][k]:+.3f})")


def profile_suite(spec: ProfileSpec, conditions: dict) -> dict:
  res = {"suite": "profile", "spec": dataclasses.asdict(spec), "conditions": conditions,
         "cores": len(os.sched_getaffinity(0)), "points": []}
  if spec.trace_dir:
    os.makedirs(spec.trace_dir, exist_ok=True)
    res["points"] = [profile_point(spec, t, e, spec.trace_dir) for t, e in spec.points]
  else:
    with tempfile.TemporaryDirectory(prefix="moejax_profile_") as root:
      res["points"] = [profile_point(spec, t, e, root) for t, e in spec.points]
  return res


def print_profile_table(res: dict) -> None:
  sp = res["spec"]
  print(f"profile ({sp['mode']}), K={sp['k']} f={sp['f']} d={sp['d']}, "
        f"{res['cores']} cores; wall ms of one traced call split by kind of XLA:CPU instruction")
  for pt in res["points"]:
    vs = {v: r for v, r in pt["variants"].items() if "error" not in r}
    print(f"\nT={pt['T']} E={pt['E']}")
    for v, r in pt["variants"].items():
      if "error" in r:
        print(f"  {v}: failed: {r['error']}")
    names = list(vs)
    head = "".join(f"{v:>14}" for v in names)
    exc = "".join(f"{'+' + v:>14}" for v in names if v != "dense")
    print(f"  {'kind':<20}{head}{exc}   (+v: excess x dense wall)")
    for k in ROWS:
      row = "".join(f"{vs[v]['wall_ms'][k]:14.1f}" for v in names)
      row += "".join(f"{vs[v].get('excess_x_dense', {}).get(k, float('nan')):14.3f}"
                     for v in names if v != "dense")
      print(f"  {k:<20}{row}")
    for label, key, fmt in (("busy thread ms", "busy_ms", "{:14.1f}"),
                            ("utilization", "utilization", "{:14.2f}"),
                            ("traced wall s", "traced_s", "{:14.3f}"),
                            ("untraced wall s", "median_s", "{:14.3f}"),
                            ("fresh MiB per call", "fresh_mib", "{:14.1f}"),
                            ("wall x dense", "x_dense", "{:14.2f}"),
                            ("CPU time x dense", "cpu_x_dense", "{:14.2f}")):
      print(f"  {label:<20}" + "".join(fmt.format(vs[v].get(key, float("nan"))) for v in names))
    for v in names:
      if v != "dense":
        tops = ", ".join(f"{o['name']} ({o['kind']}) {o['ms']:.1f}" for o in vs[v]["top"][:5])
        print(f"  top {v}: {tops}")
  print("\n" + markdown_tables(res))


def markdown_tables(res: dict) -> str:
  """One markdown table per non-dense variant: rows the kinds of work, columns
  the points, each cell 'variant ms / dense ms (+excess x dense)' of the
  traced call's wall split (the layout of docs/execution.md)."""
  pts = [p for p in res["points"] if "error" not in p["variants"].get("dense", {"error": 1})]
  names = sorted({v for p in pts for v in p["variants"] if v != "dense"})
  out = []
  for v in names:
    cols = [p for p in pts if "error" not in p["variants"].get(v, {"error": 1})]
    if not cols:
      continue
    head = "| kind (wall ms: " + v + " / dense (+excess x dense)) | " + " | ".join(
        f"T={p['T']} E={p['E']}" for p in cols) + " |"
    lines = [head, "|---|" + "---:|" * len(cols)]
    for k in ROWS:
      cells = [wall_cell(p["variants"][v], p["variants"]["dense"], k) for p in cols]
      lines.append(f"| {k} | " + " | ".join(cells) + " |")
    def row(label, fn):
      lines.append(f"| {label} | " + " | ".join(fn(p["variants"][v], p["variants"]["dense"])
                                               for p in cols) + " |")
    row("traced call", lambda r, d: f"{r['traced_s'] * 1e3:.0f} / {d['traced_s'] * 1e3:.0f} "
        f"({r['traced_s'] / d['traced_s'] - 1:+.3f})")
    row("untraced wall x dense", lambda r, d: f"{r['x_dense']:.2f}")
    row("CPU time x dense", lambda r, d: f"{r['cpu_x_dense']:.2f}")
    row("utilization (busy / cores x wall)", lambda r, d: f"{r['utilization']:.2f} / "
        f"{d['utilization']:.2f}")
    def recorded(key):  # older records lack the later rows' fields
      return all(key in p["variants"][n] for p in cols for n in (v, "dense"))
    if recorded("counts"):
      row("instructions run (elementwise)", lambda r, d: f"{sum(r['counts'].values())} "
          f"({r['counts']['elementwise']}) / {sum(d['counts'].values())} "
          f"({d['counts']['elementwise']})")
    if recorded("fresh_mib"):
      row("fresh MiB per call (pages faulted in)",
          lambda r, d: f"{r['fresh_mib']:.0f} / {d['fresh_mib']:.0f}")
    out.append("\n".join(lines))
  return "\n\n".join(out)


def run_from_flags(repeats: int, seed: int, conditions: dict) -> dict:
  try:
    spec = spec_from_flags(repeats, seed)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  return profile_suite(spec, conditions)


SUITE = registry.register(registry.Suite(
    "profile", "where the MoE layer's extra time goes, by kind of XLA instruction",
    lambda: run_from_flags(common.repeats(), common.SEED.value, bench_lib.conditions()),
    print_profile_table, outputs=(("profile_trace_dir", "dir"),)))
