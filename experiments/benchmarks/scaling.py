r"""Scaling suite (``--suite=scaling``): the MoE layer / dense FFN ratio as E and T grow.

Usage:
  python -m experiments.bench --suite=scaling --json_out=/tmp/scaling.json
  python -m experiments.bench --suite=scaling --scaling_experts=8 --scaling_tokens= \
      --scaling_k=2 --scaling_f=16 --scaling_d_model=32 --scaling_expert_sweep_tokens=64 \
      --repeats=1                                   # a smoke run: seconds

Legend: T tokens, d model width, E experts, K slots per token, f expert
hidden width.

Two sweeps at equal active compute (K and f fixed, so the dense FFN of width
K*f does the same FLOPs at every E):
  * E sweep: E in ``--scaling_experts`` (8, 32, 64, 128, 512) at
    T = ``--scaling_expert_sweep_tokens`` (8192);
  * T sweep: T in ``--scaling_tokens`` (2048, 8192, 32768) at
    E = ``--scaling_token_sweep_experts`` (64);
K = 8, f = 256, d = 512, float32 by default. A point both sweeps contain
(T=8192, E=64) is measured once. At each point, side by side in one process
(``bench_lib.time_round_robin``: round-robin repeats, medians, compile and
first run excluded; a variant whose first timed run exceeds ``slow_s`` gets
``slow_repeats`` runs), forward and forward+backward of the variants
``--scaling_variants`` (``bench_lib.jax_layer_fns`` / ``torch_layer_fns``):
``dense`` (JAX SwiGLU of width K*f), ``expert_matmuls`` (the experts' three
matmuls alone, one batched einsum per weight on M / E rows per expert already
in expert order: what XLA's matmuls cost at the experts' shapes), ``blocked``
(moejax's default, fused), ``blocked_unfused`` (permute -> 3 gmm -> unpermute),
``blocked_folded`` (the composed path with the permutation folded into the
gmm row loads and stores, ``folded_gmm``), ``torch_dense`` and ``hf_mixtral`` (Hugging Face's
``MixtralSparseMoeBlock``, its default experts implementation). JAX variants
are divided by ``dense``, torch ones by ``torch_dense``; each ratio has the
spread of the per-round ratios (repeat r of a variant over repeat r of its
dense, the same round, so both saw the same load) and its CPU-time twin.

The weight-streaming floor: whatever the kernels, a forward+backward step
moves every expert's weights through memory at least
  ``3 x (3 E d f) x bytes``: w_gate, w_up, w_down (E d f each) read in the
forward, read again in the backward, their gradient written once
(``3 E d f x bytes`` for the forward alone); divided by this machine's
memory bandwidth (:func:`copy_bandwidth`: the better of an in-place XLA
update and a numpy copy, measured at the start and at the end of the run;
the highest of these, so the floor stays a lower bound), that is a time,
printed as a ratio to the dense FFN's time. Activations are not counted (the
dense FFN streams as many).

The first-touch estimate: on this CPU, XLA allocates every execution's
outputs and temporaries afresh, and the first write to a fresh page costs a
kernel page fault (the pages are zeroed): :func:`first_touch_bandwidth`
measures that write rate, about a tenth of the in-place one. The dense FFN
has K experts' worth of weights, the MoE E, so the MoE moves
``3 (E - K) d f x bytes`` more per weight set: read twice at the copy
bandwidth and its gradient written once into fresh memory. That time over
the dense FFN's, ``excess x dense``, estimates how far above 1 the MoE's
ratio must stay if that traffic does not overlap the matmuls (an estimate,
not a bound: XLA may run independent work alongside).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import common, registry

JAX_VARIANTS = {"dense": None, "expert_matmuls": None, "blocked": dict(backend="blocked"),
                "blocked_unfused": dict(backend="blocked", fused=False, fold_permute=False),
                "blocked_folded": dict(backend="blocked", fused=False)}
TORCH_VARIANTS = ("torch_dense", "hf_mixtral")
VARIANTS = tuple(JAX_VARIANTS) + TORCH_VARIANTS
# Each row's ratio is to its own framework's dense FFN.
BASE = {**dict.fromkeys(JAX_VARIANTS, "dense"), **dict.fromkeys(TORCH_VARIANTS, "torch_dense")}
MODES = ("fwdbwd", "fwd")
MODE_LABEL = {"fwdbwd": "fwd+bwd", "fwd": "fwd"}
N_WEIGHTS = 3  # w_gate, w_up, w_down, E d f elements each
# The spec's integer fields and the flags that set them.
FLAG_OF = {"expert_sweep_tokens": "scaling_expert_sweep_tokens",
           "token_sweep_experts": "scaling_token_sweep_experts", "k": "scaling_k",
           "f": "scaling_f", "d": "scaling_d_model", "repeats": "repeats",
           "slow_repeats": "slow_repeats", "torch_threads": "torch_threads",
           "copy_mib": "scaling_copy_mib", "copy_repeats": "scaling_copy_repeats"}

_EXPERTS = flags.DEFINE_list("scaling_experts", ["8", "32", "64", "128", "512"],
                             "E values of the E sweep (empty: no E sweep)")
_TOKENS = flags.DEFINE_list("scaling_tokens", ["2048", "8192", "32768"],
                            "T values of the T sweep (empty: no T sweep)")
_E_SWEEP_T = flags.DEFINE_integer("scaling_expert_sweep_tokens", 8192, "T of the E sweep")
_T_SWEEP_E = flags.DEFINE_integer("scaling_token_sweep_experts", 64, "E of the T sweep")
_K = flags.DEFINE_integer("scaling_k", 8, "K, slots per token")
_F = flags.DEFINE_integer("scaling_f", 256, "f, expert hidden width (dense width K*f)")
_D = flags.DEFINE_integer("scaling_d_model", 512, "d, model width")
_VARIANTS = flags.DEFINE_list("scaling_variants", list(VARIANTS),
                              f"variants to time, among {','.join(VARIANTS)}")
_COPY_MIB = flags.DEFINE_integer("scaling_copy_mib", 256,
                                 "MiB of the bandwidth benchmark's copied array")
_ONCE_S = flags.DEFINE_float("scaling_once_s", 30.0,
                             "a variant whose first run exceeds this is timed by that run only")
_COPY_REPEATS = flags.DEFINE_integer("scaling_copy_repeats", 10,
                                     "timed copies of the bandwidth benchmark (median)")


@dataclasses.dataclass(frozen=True)
class ScalingSpec:
  """What one scaling run measures (the flags, checked; see the module doc)."""

  experts: tuple[int, ...] = (8, 32, 64, 128, 512)
  tokens: tuple[int, ...] = (2048, 8192, 32768)
  expert_sweep_tokens: int = 8192
  token_sweep_experts: int = 64
  k: int = 8
  f: int = 256
  d: int = 512
  variants: tuple[str, ...] = VARIANTS
  repeats: int = 5
  # The HF loop takes 10-40 s a call at large E and T: 2 timed runs for those keep the
  # default run short (bench's --slow_s / --slow_repeats override these when given).
  slow_s: float = 6.0
  slow_repeats: int = 2
  # HF's default loop took 40-50 s a fwd+bwd call at E=128 and T=32768 on the loaded 2-core
  # VM, minutes at E=512 (the backward of each expert's slice of its stacked [E, ...]
  # weights is a full [E, ...] gradient, E times over): one call each.
  once_s: float = 30.0
  torch_threads: int = os.cpu_count() or 1
  seed: int = 0
  copy_mib: int = 256
  copy_repeats: int = 10

  def __post_init__(self):
    for field, flag in FLAG_OF.items():
      if getattr(self, field) < 1:
        raise ValueError(f"error: --{flag}={getattr(self, field)} must be >= 1; "
                         "pass a positive integer")
    for name, values in (("scaling_experts", self.experts), ("scaling_tokens", self.tokens)):
      if any(v < 1 for v in values):
        raise ValueError(f"error: --{name}={','.join(map(str, values))} has a value < 1; "
                         "pass positive integers")
    es = self.experts + ((self.token_sweep_experts,) if self.tokens else ())
    if es and self.k > min(es):
      raise ValueError(f"error: --scaling_k={self.k} exceeds the smallest E={min(es)}; "
                       f"pass --scaling_k <= {min(es)}")
    unknown = sorted(set(self.variants) - set(VARIANTS))
    if unknown or not self.variants:
      raise ValueError(f"error: --scaling_variants={','.join(self.variants)}: unknown "
                       f"{unknown or 'empty'}; use a subset of {','.join(VARIANTS)}")
    if not self.points():
      raise ValueError("error: --scaling_experts and --scaling_tokens are both empty; "
                       "give at least one E or T")

  def points(self) -> list[tuple[int, int]]:
    """(T, E) of every point, E sweep first, each once."""
    out = [(self.expert_sweep_tokens, e) for e in self.experts]
    out += [(t, self.token_sweep_experts) for t in self.tokens]
    return list(dict.fromkeys(out))


def parse_ints(name: str, values: list[str]) -> tuple[int, ...]:
  """A list flag's integers ('' items dropped: ``--scaling_tokens=`` is no T sweep)."""
  try:
    return tuple(int(v) for v in values if v != "")
  except ValueError:
    raise app.UsageError(f"error: --{name}={','.join(values)} is not a list of integers; "
                         "pass e.g. 8,64") from None


def spec_from_flags(repeats: int, slow_s: Optional[float], slow_repeats: Optional[int],
                    torch_threads: int, seed: int) -> ScalingSpec:
  """The ScalingSpec of the scaling_* flags (``slow_s`` / ``slow_repeats``: None for the
  spec's defaults); a bad value is one UsageError line."""
  default = ScalingSpec()
  slow_s = default.slow_s if slow_s is None else slow_s
  slow_repeats = default.slow_repeats if slow_repeats is None else slow_repeats
  ints = lambda flag: parse_ints(flag.name, flag.value)
  try:
    return ScalingSpec(
        experts=ints(_EXPERTS), tokens=ints(_TOKENS), expert_sweep_tokens=_E_SWEEP_T.value,
        token_sweep_experts=_T_SWEEP_E.value, k=_K.value, f=_F.value, d=_D.value,
        variants=tuple(_VARIANTS.value), repeats=repeats, slow_s=slow_s,
        slow_repeats=slow_repeats, torch_threads=torch_threads, seed=seed,
        copy_mib=_COPY_MIB.value, copy_repeats=_COPY_REPEATS.value, once_s=_ONCE_S.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None


# --- The weight-streaming floor. ---------------------------------------------

def weight_stream_bytes(e: int, d: int, f: int, itemsize: int = 4) -> dict[str, int]:
  """Bytes of expert weights (and gradients) one step must move, by mode.

  fwd: each of w_gate, w_up, w_down ([E, d, f] / [E, f, d]) read once;
  fwdbwd: read in the forward, read again in the backward, gradient written once.
  """
  weights = N_WEIGHTS * e * d * f * itemsize
  return {"fwd": weights, "fwdbwd": 3 * weights}


def copy_bandwidth(mib: int, repeats: int) -> dict:
  """Memory bandwidth: bytes read + written per second streaming an f32 array of ``mib``
  MiB, the better of two copies timed round-robin (medians, first run excluded).

  ``xla``: a jitted in-place ``x = x + 1`` (the buffer donated, so no new allocation);
  ``numpy``: ``np.copyto`` into a preallocated array. A jitted copy into a fresh buffer
  is not used: on CPU its time includes the kernel zeroing the newly allocated pages.
  """
  n = mib * 2 ** 20 // 4
  holder = {"x": jnp.arange(n, dtype=jnp.float32)}
  bump = jax.jit(lambda a: a + 1.0, donate_argnums=0)
  src = np.arange(n, dtype=np.float32)
  dst = np.empty_like(src)

  def xla():
    holder["x"] = bump(holder["x"])
    return holder["x"]

  timed = bench_lib.time_round_robin({"xla": xla, "numpy": lambda: np.copyto(dst, src)},
                                     repeats)
  moved = 2 * n * 4
  out = {name: {"median_s": t["median_s"], "all_s": t["all_s"],
                "bytes_per_s": moved / t["median_s"]} for name, t in timed.items()}
  return {"bytes": moved, "bytes_per_s": max(r["bytes_per_s"] for r in out.values()), **out}


def first_touch_bandwidth(mib: int, repeats: int) -> dict:
  """Bytes per second written into freshly allocated memory: a jitted fill of an f32
  array of ``mib`` MiB, returned as a new buffer each call (median, first run excluded).

  On CPU the time is mostly the kernel's page faults (zeroing each new page), which
  every step pays for the outputs and temporaries XLA allocates, gradients included.
  """
  n = mib * 2 ** 20 // 4
  fill = jax.jit(lambda v: jnp.full((n,), v, jnp.float32))
  t = bench_lib.time_round_robin({"fill": lambda: fill(jnp.float32(1.0))}, repeats)["fill"]
  return {"bytes": n * 4, "median_s": t["median_s"], "all_s": t["all_s"],
          "bytes_per_s": n * 4 / t["median_s"]}


def add_floors(point: dict, bytes_per_s: float,
               touch_bytes_per_s: Optional[float] = None) -> None:
  """point['floor'][mode]: the streaming bytes, their time at ``bytes_per_s`` and its
  ratio to the JAX dense FFN's median time (None when dense was not timed); with
  ``touch_bytes_per_s``, the first-touch estimate of the MoE's excess over dense
  (module doc): ``excess_bytes``, ``excess_s``, ``excess_x_dense``."""
  e, k, d, f, b = point["E"], point["K"], point["d"], point["f"], point["itemsize"]
  moved = weight_stream_bytes(e, d, f, b)
  excess = weight_stream_bytes(max(e - k, 0), d, f, b)["fwd"]  # one weight set
  dense = point["variants"].get("dense", {})
  point["floor"] = {}
  for mode in MODES:
    s = moved[mode] / bytes_per_s
    med = dense.get(mode, {}).get("median_s")
    fl = point["floor"][mode] = {"bytes": moved[mode], "s": s,
                                 "x_dense": None if med is None else s / med}
    if touch_bytes_per_s:
      reads = excess * (2 if mode == "fwdbwd" else 1)
      es = reads / bytes_per_s + (excess / touch_bytes_per_s if mode == "fwdbwd" else 0.0)
      fl.update(excess_bytes=reads + (excess if mode == "fwdbwd" else 0), excess_s=es,
                excess_x_dense=None if med is None else es / med)


# --- Timing one point. -------------------------------------------------------

def add_ratios(table: dict) -> None:
  """Each row's ratio to its framework's dense (``BASE``): of the medians, of the CPU
  medians, and the spread of the per-round ratios (repeat r over the base's repeat r)."""
  for name, row in table.items():
    base = table.get(BASE[name], {})
    for mode, r in row.items():
      b = base.get(mode, {})
      if "median_s" not in r:
        continue
      r["spread_s"] = bench_lib.spread(r["all_s"])
      if "median_s" not in b:
        continue
      r["ratio_to_dense"] = r["median_s"] / b["median_s"]
      r["cpu_ratio_to_dense"] = r["cpu_s"] / b["cpu_s"]
      rounds = min(len(r["all_s"]), len(b["all_s"]))
      r["ratio_spread"] = bench_lib.spread([a / c for a, c in zip(r["all_s"][:rounds],
                                                         b["all_s"][:rounds])])


def layer_fns(prob: dict, spec: ScalingSpec) -> tuple[dict, Optional[str]]:
  """({'<variant>/<mode>': thunk}, why torch was skipped or None) for spec.variants."""
  fns = bench_lib.jax_layer_fns(prob, {n: kw for n, kw in JAX_VARIANTS.items()
                                       if n in spec.variants})
  note = None
  if set(TORCH_VARIANTS) & set(spec.variants):
    torch_fns = bench_lib.torch_layer_fns(prob, spec.torch_threads, ("eager",))
    note = torch_fns.pop("_skipped", None)
    fns.update({n: fn for n, fn in torch_fns.items() if n.split("/")[0] in spec.variants})
  return fns, note


def run_point(spec: ScalingSpec, t: int, e: int) -> dict:
  """Every variant's fwd and fwd+bwd at (T, E), round-robin, with ratios and loads."""
  load_before = os.getloadavg()[0]
  prob = bench_lib.layer_problem(t, spec.d, e, spec.k, spec.f, seed=spec.seed)
  fns, note = layer_fns(prob, spec)
  timed = bench_lib.time_round_robin(fns, spec.repeats, spec.slow_s, spec.slow_repeats,
                                     slow_after_compile=True, once_s=spec.once_s)
  table = bench_lib.split_modes(timed)
  add_ratios(table)
  del fns, prob
  jax.clear_caches()  # the point's executables and their buffers go before the next one
  return {"T": t, "E": e, "K": spec.k, "f": spec.f, "d": spec.d, "itemsize": 4,
          "dense_width": spec.k * spec.f,
          "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0],
          "torch_skipped": note, "variants": table}


def point_key(t: int, e: int) -> str:
  return f"T{t}_E{e}"


def scaling_suite(spec: ScalingSpec, conditions: dict) -> dict:
  """Bandwidth, every point of both sweeps, bandwidth again, the floors (module doc)."""
  bw_start = copy_bandwidth(spec.copy_mib, spec.copy_repeats)
  touch = first_touch_bandwidth(spec.copy_mib, spec.copy_repeats)
  logging.info("copy bandwidth %.2f GB/s, first touch %.2f GB/s",
               bw_start["bytes_per_s"] / 1e9, touch["bytes_per_s"] / 1e9)
  points = {}
  for t, e in spec.points():
    points[point_key(t, e)] = p = run_point(spec, t, e)
    print(progress_line(p), flush=True)
  bw_end = copy_bandwidth(spec.copy_mib, spec.copy_repeats)
  bytes_per_s = max(bw_start["bytes_per_s"], bw_end["bytes_per_s"])
  for p in points.values():
    add_floors(p, bytes_per_s, touch["bytes_per_s"])
  return {
      "conditions": conditions, "spec": dataclasses.asdict(spec), "dtype": "float32",
      "bandwidth": {"bytes_per_s": bytes_per_s, "start": bw_start, "end": bw_end,
                    "copy_mib": spec.copy_mib, "first_touch": touch},
      "sweeps": {"experts": [point_key(spec.expert_sweep_tokens, e) for e in spec.experts],
                 "tokens": [point_key(t, spec.token_sweep_experts) for t in spec.tokens]},
      "points": points, "conditions_after": {"load_avg_1_5_15": list(os.getloadavg())}}


# --- Printing. ---------------------------------------------------------------

def _ratio(point: dict, name: str, mode: str, key: str = "ratio_to_dense"):
  return point["variants"].get(name, {}).get(mode, {}).get(key)


def _fmt(v, spec_: str = ".2f") -> str:
  return "-" if v is None else format(v, spec_)


def progress_line(p: dict) -> str:
  d = p["variants"].get("dense", {}).get("fwdbwd", {}).get("median_s")
  cells = ", ".join(f"{n} {_fmt(_ratio(p, n, 'fwdbwd'))}" for n in p["variants"]
                    if n not in ("dense", "torch_dense"))
  return (f"T={p['T']} E={p['E']}: dense fwd+bwd {_fmt(d, '.3f')} s; x dense: {cells}; "
          f"load {p['load_1min_before']:.2f} -> {p['load_1min_after']:.2f}")


def print_scaling_table(res: dict) -> None:
  """The full per-point table, then the markdown tables for docs/execution.md."""
  bw = res["bandwidth"]
  each = "; ".join(f"{when} " + ", ".join(f"{k} {bw[when][k]['bytes_per_s'] / 1e9:.2f}"
                                          for k in ("xla", "numpy"))
                   for when in ("start", "end"))
  print(f"\ncopy bandwidth {bw['bytes_per_s'] / 1e9:.2f} GB/s (read + write of "
        f"{bw['copy_mib']} MiB, the best of: {each}); float32")
  if "first_touch" in bw:
    print(f"first-touch write bandwidth {bw['first_touch']['bytes_per_s'] / 1e9:.2f} GB/s "
          f"(a fresh {bw['copy_mib']} MiB buffer filled)")
  print("(x dense: JAX variants vs dense, torch variants vs torch_dense; [min-max] of the "
        "per-round ratios; cpu: the ratio in process CPU time; *: one run only, the first)")
  for p in res["points"].values():
    print(f"\nT={p['T']} d={p['d']} E={p['E']} K={p['K']} f={p['f']}; load "
          f"{p['load_1min_before']:.2f} -> {p['load_1min_after']:.2f}")
    print(f"{'variant':<18}" + "".join(f"{MODE_LABEL[m] + ' s':>10}{'x dense':>9}"
                                       f"{'[min-max]':>13}{'cpu x':>7}" for m in MODES)
          + f"{'runs':>6}")
    for name, row in p["variants"].items():
      line = f"{name:<18}"
      for m in MODES:
        r = row.get(m, {})
        if "median_s" not in r:
          state = "failed" if "error" in r else "refused" if "refused" in r else "-"
          line += f"{state:>10}{'-':>9}{'-':>13}{'-':>7}"
          continue
        rs = r.get("ratio_spread")
        rng = "-" if rs is None else f"{rs['min']:.2f}-{rs['max']:.2f}"
        star = "*" if r.get("first_run_only") else ""
        line += (f"{star + format(r['median_s'], '.3f'):>10}{_fmt(r.get('ratio_to_dense')):>9}"
                 f"{rng:>13}"
                 f"{_fmt(r.get('cpu_ratio_to_dense')):>7}")
      runs = max((r.get("runs", 0) for r in row.values()), default=0)
      errs = "; ".join(f"{m}: {(r.get('error') or r['refused'])[:80]}" for m, r in row.items()
                       if "error" in r or "refused" in r)
      print(line + f"{runs:>6}" + (f"  ({errs})" if errs else ""))
    fl = p["floor"]
    print(f"{'floor':<18}" + "".join(
        f"{fl[m]['s']:>10.3f}{_fmt(fl[m]['x_dense'], '.3f'):>9}{'':>13}{'':>7}" for m in MODES)
          + f"  ({fl['fwdbwd']['bytes'] / 2 ** 20:.0f} MiB fwd+bwd)")
    if "excess_s" in fl["fwdbwd"]:
      print(f"{'excess (1st touch)':<18}" + "".join(
          f"{fl[m]['excess_s']:>10.3f}{_fmt(fl[m]['excess_x_dense'], '.3f'):>9}{'':>13}{'':>7}"
          for m in MODES) + f"  ({fl['fwdbwd']['excess_bytes'] / 2 ** 20:.0f} MiB fwd+bwd"
          " more than dense)")
    if p.get("torch_skipped"):
      print(f"{'torch variants':<18}skipped: {p['torch_skipped']}")
  print()
  print(markdown_tables(res))


def markdown_tables(res: dict) -> str:
  """One markdown table per sweep and mode, in the layout of docs/execution.md."""
  spec, bw = res["spec"], res["bandwidth"]["bytes_per_s"] / 1e9
  touch = res["bandwidth"].get("first_touch", {}).get("bytes_per_s", 0) / 1e9
  blocks = []
  for sweep, col in (("experts", "E"), ("tokens", "T")):
    keys = res["sweeps"][sweep]
    if not keys:
      continue
    fixed = (f"T={spec['expert_sweep_tokens']}" if sweep == "experts"
             else f"E={spec['token_sweep_experts']}")
    for mode in MODES:
      lab = MODE_LABEL[mode]
      lines = [f"{col} sweep, {lab} ({fixed}, K={spec['k']}, f={spec['f']}, d={spec['d']}, "
               f"float32; copy bandwidth {bw:.2f} GB/s, first touch {touch:.2f} GB/s):", "",
               f"| {col} | dense {lab} s | moejax {lab} x dense [spread] | matmuls alone x dense "
               f"| unfused x dense | folded x dense | HF x torch dense | floor x dense "
               f"| excess x dense | load |",
               "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
      for key in keys:
        lines.append(_markdown_row(res["points"][key], col, mode))
      if any(_once(res["points"][k], "hf_mixtral", mode) for k in keys):
        lines += ["", f"*: one call only (its first took over {spec['once_s']:.0f} s)."]
      blocks.append("\n".join(lines))
  return "\n\n".join(blocks)


def _once(p: dict, name: str, mode: str) -> str:
  """'*' where the variant was timed by its first run only (``once_s``)."""
  return "*" if p["variants"].get(name, {}).get(mode, {}).get("first_run_only") else ""


def _markdown_row(p: dict, col: str, mode: str) -> str:
  dense = p["variants"].get("dense", {}).get(mode, {}).get("median_s")
  moe = _ratio(p, "blocked", mode)
  rs = _ratio(p, "blocked", mode, "ratio_spread")
  moe_s = "-" if moe is None else (f"{moe:.2f}" + (
      f" [{rs['min']:.2f}-{rs['max']:.2f}]" if rs else ""))
  return (f"| {p[col]} | {_fmt(dense, '.3f')} | {moe_s} "
          f"| {_fmt(_ratio(p, 'expert_matmuls', mode))} "
          f"| {_fmt(_ratio(p, 'blocked_unfused', mode))} "
          f"| {_fmt(_ratio(p, 'blocked_folded', mode))} "
          f"| {_fmt(_ratio(p, 'hf_mixtral', mode))}{_once(p, 'hf_mixtral', mode)} "
          f"| {_fmt(p['floor'][mode]['x_dense'], '.3f')} "
          f"| {_fmt(p['floor'][mode].get('excess_x_dense'), '.3f')} "
          f"| {p['load_1min_before']:.1f} -> {p['load_1min_after']:.1f} |")


def run() -> dict:
  """--suite=scaling: --slow_s / --slow_repeats apply only when given (else the spec's)."""
  given = lambda flag: flag.value if flag.present else None
  spec = spec_from_flags(common.repeats(), given(common.SLOW_S),
                         given(common.SLOW_REPEATS), common.TORCH_THREADS.value,
                         common.SEED.value)
  return scaling_suite(spec, bench_lib.conditions())


SUITE = registry.register(registry.Suite(
    "scaling", "the layer / dense ratio as E and T grow, with a weight-streaming floor",
    run, print_scaling_table))
