"""Flag-free pieces of the layer and gmm benchmarks.

Legend: T tokens, d model width, E FFN experts, K slots per token, f expert
hidden width, m / k / n / G the grouped matmul's rows, contraction, output
width and groups.

Shared by ``experiments.bench`` (``--suite=layer`` / ``--suite=gmm``) and
``experiments.device_check``; nothing here defines absl flags, so both can
import it.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from moejax.execution import gmm as gmm_lib
from moejax.execution import grouped_ffn
from moejax.execution import shape_choice
from moejax.routing.types import RoutingResult
from moejax.topology import experts as experts_lib

# The two layer shapes of docs/execution.md (T = 8192, d = 512 by default), and two
# more for ``auto``'s shape rule (--shapes): groups of M / E = 512 and 8192 rows.
SHAPES = {"fine": dict(num_experts=64, k=8, f=256), "coarse": dict(num_experts=8, k=2, f=1024),
          "e32k2": dict(num_experts=32, k=2, f=1024), "e8k8": dict(num_experts=8, k=8, f=256),
          # configs/default.py's MoE layer (with --tokens=2048 --d_model=128: one train step)
          "default": dict(num_experts=16, k=2, f=128)}


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def conditions() -> dict:
  """Where a benchmark ran. On CPU the allocator settings matter: XLA allocates every
  execution's buffers afresh, and first-touch page faults are a large part of a step
  with many experts (docs/execution.md), so the glibc tunables and the kernel's
  transparent-huge-page mode are recorded too."""
  out = {"platform": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
         "device_kind": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
         "load_avg_1_5_15": list(os.getloadavg()), "jax": jax.__version__,
         "python": platform.python_version(),
         "processor": platform.processor() or platform.machine(),
         "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}
  try:
    with open(THP_ENABLED) as fh:
      out["transparent_hugepage"] = fh.read().strip()
  except OSError:
    out["transparent_hugepage"] = None
  return out


def auto_rule(platform: Optional[str] = None) -> shape_choice.ShapeRule:
  """The shape rule ``backend='auto'`` resolves to on ``platform`` (default: JAX's)."""
  platform = jax.default_backend() if platform is None else platform
  backend = gmm_lib.resolve_backend("auto", platform)
  large = gmm_lib.get_backend(backend).large_groups_on(platform)
  return shape_choice.ShapeRule(backend, *large)


def auto_decision(t: int, d: int, e: int, k: int, f: int) -> dict:
  """What ``auto`` runs at this layer shape here: {'backend', 'rule', 'line'}."""
  rule = auto_rule()
  backend = rule.pick(t * k, e)
  line = shape_choice.Decision(rule, t, k, e, d, f, backend).line()
  return {"backend": backend, "rule": rule.describe(), "line": line}


def native_backends() -> tuple[list[str], dict[str, str]]:
  """(gmm backends that run natively here, {skipped backend: why})."""
  run, skipped = [], {}
  for name in gmm_lib.backend_names():
    try:
      gmm_lib.check_available(name)
      run.append(name)
    except gmm_lib.GmmError as e:
      skipped[name] = str(e).split(". Fix:")[0] + " (interpret mode is not a performance path)"
  return run, skipped


def block(x):
  return jax.block_until_ready(x)


# Where time_round_robin says what each variant did as it goes (None: nowhere). The bench
# binary sets its stdout, so that a suite that runs for minutes shows each variant's first
# run or failure at once, before its table.
PROGRESS: list = [None]


def progress(line: str) -> None:
  """Says one line of a suite's progress where the bench binary shows it (:data:`PROGRESS`)."""
  out = PROGRESS[0]
  if out is not None:
    print(line, file=out, flush=True)


class BenchFailed(RuntimeError):
  """A suite that cannot make its table: a part it needs failed (the message says which)."""


class Refused(Exception):
  """A variant not run here: it would need more memory than the machine has."""


def available_memory() -> int:
  """Bytes of memory available to a new allocation now (MemAvailable, else all of it)."""
  try:
    with open("/proc/meminfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _bytes(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
    if n >= size:
      return f"{n / size:.1f} {unit}"
  return f"{n / 2**10:.1f} KiB"


def memory_checked(fn, args, what: str, available: Optional[Callable[[], int]] = None):
  """A thunk of jitted ``fn`` on ``args`` that, on its first call, compiles it, reads XLA's
  estimate of the bytes it needs (arguments, outputs, temporaries) and raises
  :class:`Refused` in one line when that exceeds :func:`available_memory`, before running
  anything; else it runs the compiled program (compiled once)."""
  compiled = []

  def thunk():
    if not compiled:
      exe = fn.lower(*args).compile()
      m = exe.memory_analysis()
      need = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
              - m.alias_size_in_bytes) if m is not None else 0
      have = (available or available_memory)()
      if need > have:
        raise Refused(f"{what} needs {_bytes(need)} here, more than the {_bytes(have)} "
                      "available; not run")
      compiled.append(exe)
    return compiled[0](*args)
  return thunk


def error_text(e: BaseException) -> str:
  """A failed variant's row: the exception's type and first line (a traceback would not fit
  the table, and the suite goes on)."""
  return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def variant_failed(label: str, e: BaseException) -> str:
  """Says ``label: FAILED: ...`` as it happens (:func:`progress`); returns the error text of
  its row ``{"error": ...}``, which :func:`failures` finds."""
  text = error_text(e)
  progress(f"{label}: FAILED: {text}")
  return text


def time_round_robin(fns: dict[str, Callable[[], object]], repeats: int,
                     slow_s: float = float("inf"), slow_repeats: int = 1,
                     inner: int = 1, slow_after_compile: bool = False,
                     once_s: float = float("inf")) -> dict[str, dict]:
  """Median seconds per call of each fn; compile and first run excluded.

  Repeats go round-robin over the variants so that load from other
  processes hits them alike. ``cpu_s`` is the process CPU time per call
  (every thread), which other processes' load disturbs less than wall time.
  ``inner`` calls are made per timed repeat (short device kernels). A
  variant that fails on its first run (e.g. out of memory) is reported with
  its error instead of a time, and the others still run. A variant whose
  first run exceeds ``slow_s`` gets ``slow_repeats`` timed runs; with
  ``slow_after_compile`` its first *timed* run is judged instead, so a
  long compilation does not cost a fast variant its repeats. A variant whose
  first run exceeds ``once_s`` is not run again: that run is its only time
  (``first_run_only``; meant for code with nothing to compile, e.g. torch).
  """
  first, first_cpu, failed, refused = {}, {}, {}, {}
  for name, fn in fns.items():
    c0, t0 = time.process_time(), time.perf_counter()
    try:
      block(fn())
    except Refused as e:
      refused[name] = str(e)
      progress(f"  {name}: refused: {e}")
      continue
    except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
      failed[name] = error_text(e)
      progress(f"  {name}: FAILED: {failed[name]}")
      continue
    first[name], first_cpu[name] = time.perf_counter() - t0, time.process_time() - c0
    progress(f"  {name}: compiled and ran in {first[name]:.2f}s")
  once = {n for n, t in first.items() if t > once_s}
  live = {n: f for n, f in fns.items() if n in first and n not in once}
  judge = lambda s: slow_repeats if s > slow_s else repeats
  want = {n: (max(repeats, slow_repeats, 1) if slow_after_compile else judge(first[n]))
          for n in live}
  times = {n: [] for n in live}
  cpu = {n: [] for n in live}
  for r in range(max(want.values(), default=0)):
    if slow_after_compile and r == 1:  # every variant has one timed run now
      want = {n: max(judge(times[n][0]), 1) for n in live}
    for name, fn in live.items():
      if r < want[name]:
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(inner):
          out = fn()
        block(out)
        times[name].append((time.perf_counter() - t0) / inner)
        cpu[name].append((time.process_time() - c0) / inner)
  out = {n: {"median_s": float(np.median(ts)), "cpu_s": float(np.median(cpu[n])),
             "runs": len(ts), "all_s": [round(t, 6) for t in ts],
             "first_run_s": round(first[n], 3)}
         for n, ts in times.items()}
  out.update({n: {"median_s": first[n], "cpu_s": first_cpu[n], "runs": 1,
                  "all_s": [round(first[n], 6)], "first_run_s": round(first[n], 3),
                  "first_run_only": True} for n in once})
  out.update({n: {"error": err} for n, err in failed.items()})
  out.update({n: {"refused": why} for n, why in refused.items()})
  return {n: out[n] for n in fns if n in out}  # in the callers' order


def failures(res, where: str = "") -> list[str]:
  """``'PATH: error'`` of every failed run in a suite's result (its ``{"error": ...}``
  entries, at any depth; refused and skipped variants are not failures)."""
  out = []
  if isinstance(res, dict):
    if isinstance(res.get("error"), str):
      out.append(f"{where or 'suite'}: {res['error']}")
    for key, value in res.items():
      if key != "error":
        out += failures(value, f"{where}/{key}" if where else str(key))
  elif isinstance(res, list):
    for i, value in enumerate(res):
      out += failures(value, f"{where}[{i}]")
  return out


# --- Layer problems. --------------------------------------------------------

def random_routing(key, t, e, k) -> RoutingResult:
  """A fixed random router: Gaussian logits, top-K, softmax over the K."""
  logits = jax.random.normal(key, (t, e), jnp.float32)
  vals, ids = jax.lax.top_k(logits, k)
  return RoutingResult(expert_ids=ids.astype(jnp.int32), weights=jax.nn.softmax(vals, -1),
                       valid=jnp.ones((t, k), bool), probs=jax.nn.softmax(logits, -1),
                       logits=logits)


def dense_ffn(p, x):
  h = jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])
  return h @ p["w_down"]


def expert_rows(x, num_experts: int, k: int):
  """[E, C, d] rows in expert order, C = ceil(T K / E): row c of expert e is token
  (e C + c) mod T, so every expert gets the same count (the ``expert_matmuls`` input)."""
  t, d = x.shape
  c = -(-t * k // num_experts)
  return jnp.take(x, jnp.arange(num_experts * c) % t, axis=0).reshape(num_experts, c, d)


def expert_matmuls(p, xe):
  """The experts' three matmuls alone, one batched einsum per weight over rows already
  grouped by expert: no routing, sort, gather, combine or padding. Its time over the
  dense FFN's is what XLA's matmuls at the experts' shapes cost by themselves."""
  return experts_lib.experts_dense(p, xe, "swiglu")


def gshard_ffn(p, x, ids, weights, *, num_experts, capacity_factor, group):
  """GShard (Lepikhin et al. 2006.16668) one-hot dispatch and combine.

  Tokens are split into groups of ``group``; in each group expert e keeps
  C = ceil(cf * group * K / E) copies, slot-major priority (all top-1 before
  top-2). Dispatch and combine are dense [G, S, E, C] einsums.
  """
  t, d = x.shape
  k = ids.shape[1]
  s = min(group, t)
  g = t // s
  c = int(np.ceil(capacity_factor * s * k / num_experts))
  onehot = jax.nn.one_hot(ids.reshape(g, s, k), num_experts, dtype=jnp.int32)  # [G,S,K,E]
  sm = jnp.swapaxes(onehot, 1, 2).reshape(g, k * s, num_experts)  # slot-major
  pos = (jnp.cumsum(sm, axis=1) - 1).reshape(g, k, s, num_experts).swapaxes(1, 2)
  keep = (onehot > 0) & (pos < c)
  # A token picks an expert in at most one slot, so summing over K selects it.
  pos_e = jnp.sum(jnp.where(keep, pos, 0), axis=2)  # [G,S,E]
  kept_e = jnp.any(keep, axis=2)
  gate_e = jnp.einsum("gsk,gske->gse", weights.reshape(g, s, k).astype(x.dtype),
                      keep.astype(x.dtype))
  dispatch = jax.nn.one_hot(jnp.where(kept_e, pos_e, c), c, dtype=x.dtype)  # [G,S,E,C]
  combine = dispatch * gate_e[..., None]
  xg = x.reshape(g, s, d)
  xe = jnp.einsum("gsec,gsd->egcd", dispatch, xg)
  a, b = experts_lib.split_gate_up(jnp.einsum("egcd,edf->egcf", xe, p["w_gate_up"]))
  h = jax.nn.silu(a) * b
  ye = jnp.einsum("egcf,efd->egcd", h, p["w_down"])
  return jnp.einsum("gsec,egcd->gsd", combine, ye).reshape(t, d)


def layer_problem(t: int, d: int, e: int, k: int, f: int, *, dtype=jnp.float32,
                  seed: int = 0) -> dict:
  """Inputs, a fixed routing, MoE params (the gate|up layout: w_gate_up [E, d, 2f],
  w_down [E, f, d]) and dense params of width K*f."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 9)
  s_in, s_h = d ** -0.5, f ** -0.5
  cast = lambda a: a.astype(dtype)
  return {
      "dims": dict(T=t, d=d, E=e, K=k, f=f),
      "x": cast(jax.random.normal(ks[0], (t, d), jnp.float32)),
      "cot": cast(jax.random.normal(ks[1], (t, d), jnp.float32)),
      "routing": random_routing(ks[2], t, e, k),
      "moe": {"w_gate_up": cast(experts_lib.fuse_gate_up(
                  jax.random.normal(ks[3], (e, d, f)) * s_in,
                  jax.random.normal(ks[4], (e, d, f)) * s_in)),
              "w_down": cast(jax.random.normal(ks[5], (e, f, d)) * s_h)},
      "dense": {"w_gate": cast(jax.random.normal(ks[6], (d, k * f)) * s_in),
                "w_up": cast(jax.random.normal(ks[7], (d, k * f)) * s_in),
                "w_down": cast(jax.random.normal(ks[8], (k * f, d)) * (k * f) ** -0.5)},
  }


def layer_fwd_flops(prob: dict) -> float:
  """2 T d (K f) x 3: the forward FLOPs of the dense FFN and of the routed experts."""
  dm = prob["dims"]
  return 2.0 * dm["T"] * dm["d"] * dm["K"] * dm["f"] * 3


def jax_layer_fns(prob: dict, variants: dict[str, Optional[dict]]) -> dict[str, Callable]:
  """{'<name>/fwd', '<name>/fwdbwd': thunk} for the JAX variants.

  ``variants`` maps a name to the keyword arguments of
  :func:`moejax.execution.grouped_ffn.routed_experts` (backend, fused, ...);
  the names ``dense``, ``expert_matmuls`` (:func:`expert_matmuls`) and ``gshard`` (value:
  its options) are the baselines.
  fwd+bwd differentiates params, x and the gate weights against a fixed
  random cotangent; the routing is computed outside the timed functions.
  """
  x, cot, routing = prob["x"], prob["cot"], prob["routing"]
  e = prob["dims"]["E"]
  out = {}
  for name, kw in variants.items():
    if name == "dense":
      fwd = jax.jit(dense_ffn)
      fb = jax.jit(jax.grad(lambda p, x: jnp.vdot(dense_ffn(p, x), cot), (0, 1)))
      out["dense/fwd"] = lambda fwd=fwd: fwd(prob["dense"], x)
      out["dense/fwdbwd"] = lambda fb=fb: fb(prob["dense"], x)
      continue
    if name == "expert_matmuls":
      xe = expert_rows(x, e, prob["dims"]["K"])
      xe_cot = jax.random.normal(jax.random.PRNGKey(1), xe.shape, xe.dtype)
      fwd = jax.jit(expert_matmuls)
      fb = jax.jit(jax.grad(lambda p, xe: jnp.vdot(expert_matmuls(p, xe), xe_cot), (0, 1)))
      out[f"{name}/fwd"] = lambda fwd=fwd, xe=xe: fwd(prob["moe"], xe)
      out[f"{name}/fwdbwd"] = lambda fb=fb, xe=xe: fb(prob["moe"], xe)
      continue
    if name == "gshard":
      fn = (lambda p, x, w, ids, kw=kw: gshard_ffn(p, x, ids, w, num_experts=e, **kw))
    else:
      def fn(p, x, w, ids, kw=kw):
        r = routing.replace(expert_ids=ids, weights=w)
        return grouped_ffn.routed_experts(p, x, r, num_experts=e, activation="swiglu", **kw)
    fwd = jax.jit(fn)
    fb = jax.jit(jax.grad(lambda p, x, w, ids, fn=fn: jnp.vdot(fn(p, x, w, ids), cot),
                          (0, 1, 2)))
    args = (prob["moe"], x, routing.weights.astype(x.dtype), routing.expert_ids)
    if (kw or {}).get("backend") == "ragged_dot" and jax.default_backend() == "cpu":
      # XLA:CPU runs ragged_dot as a dense product over every group (a [G, M, K] masked
      # copy of the rows: tens of GB at the fine shape), so its memory is checked first.
      for mode, f in (("fwd", fwd), ("fwdbwd", fb)):
        out[f"{name}/{mode}"] = memory_checked(f, args, f"{name}/{mode} (ragged_dot's dense "
                                                        "CPU fallback)")
      continue
    out[f"{name}/fwd"] = lambda fwd=fwd, args=args: fwd(*args)
    out[f"{name}/fwdbwd"] = lambda fb=fb, args=args: fb(*args)
  return out


def torch_layer_fns(prob: dict, threads: int, hf_implementations=("eager",)) -> dict:
  """The peer in PyTorch: Hugging Face's MixtralSparseMoeBlock and a dense SwiGLU FFN.

  Same T, d, E, K, f and float32 as ``prob``; the dense FFN (width K*f) uses
  the JAX problem's weights. The Mixtral block routes with its own top-K
  softmax router (the gate matmul is 2 T d E FLOPs, ~1% at the fine shape)
  and has random weights of the same scale. ``hf_implementations``: the
  block's ``experts_implementation`` values to time (``eager`` is the
  per-expert loop of modeling_mixtral.py). Returns {} with a note under
  ``'_skipped'`` when torch / transformers are not installed (the
  ``interop`` extra).
  """
  try:
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
  except ImportError as e:
    return {"_skipped": f"torch/transformers not installed ({e}); pip install -e .[interop]"}
  torch.set_num_threads(threads)
  dm = prob["dims"]
  t, d, e, k, f = dm["T"], dm["d"], dm["E"], dm["K"], dm["f"]
  to_t = lambda a: torch.from_numpy(np.array(a, np.float32))
  x = to_t(prob["x"])
  cot = to_t(prob["cot"])
  dense = {n: to_t(v).requires_grad_(True) for n, v in prob["dense"].items()}

  def dense_fwd(x):
    h = torch.nn.functional.silu(x @ dense["w_gate"]) * (x @ dense["w_up"])
    return h @ dense["w_down"]

  fns = {}

  def add(name, module_fwd, params):
    def fwd():
      with torch.no_grad():
        module_fwd(x)

    def fwdbwd():
      for p in params:
        p.grad = None
      xg = x.detach().requires_grad_(True)
      module_fwd(xg).backward(cot)

    fns[f"{name}/fwd"] = fwd
    fns[f"{name}/fwdbwd"] = fwdbwd

  add("torch_dense", dense_fwd, list(dense.values()))
  for impl in hf_implementations:
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=e,
                        num_experts_per_tok=k, router_jitter_noise=0.0,
                        experts_implementation=None if impl == "eager" else impl)
    block_m = MixtralSparseMoeBlock(cfg).float()
    with torch.no_grad():
      block_m.experts.gate_up_proj.normal_(0.0, d ** -0.5)
      block_m.experts.down_proj.normal_(0.0, f ** -0.5)
      block_m.gate.weight.normal_(0.0, d ** -0.5)
    name = "hf_mixtral" if impl == "eager" else f"hf_mixtral_{impl}"
    add(name, lambda xx, m=block_m: m(xx.view(1, t, d)).view(t, d), list(block_m.parameters()))
  return fns


def spread(values) -> dict:
  """min, max and the interquartile range (q25, q75) of a list of seconds or ratios."""
  v = np.asarray(values, np.float64)
  q25, q75 = np.percentile(v, [25, 75])
  return {"min": float(v.min()), "max": float(v.max()), "q25": float(q25), "q75": float(q75)}


def ratios_to(table: dict, base: str) -> None:
  """Adds ratio_to_<base> (median and CPU time) to every row of a layer table."""
  ref = table.get(base)
  for row in table.values():
    for mode in ("fwd", "fwdbwd"):
      r, b = row.get(mode, {}), (ref or {}).get(mode, {})
      if "median_s" in r and "median_s" in b:
        r[f"ratio_to_{base}"] = r["median_s"] / b["median_s"]
        r[f"cpu_ratio_to_{base}"] = r["cpu_s"] / b["cpu_s"]


def split_modes(timed: dict) -> dict:
  """{'name/mode': res} -> {name: {mode: res}}."""
  table = {}
  for key, res in timed.items():
    name, mode = key.split("/")
    table.setdefault(name, {})[mode] = res
  return table


# --- Grouped-matmul problems. -----------------------------------------------

def uneven_group_sizes(key, m: int, groups: int) -> jax.Array:
  """Sizes summing to m, spread like a skewed router (Dirichlet(1)), one empty."""
  p = np.asarray(jax.random.dirichlet(key, jnp.ones((groups,))), np.float64)
  p[groups // 2] = 0.0
  sizes = np.floor(p / p.sum() * m).astype(np.int64)
  sizes[0] += m - sizes.sum()
  return jnp.asarray(sizes, jnp.int32)


def rel_err(got, want) -> float:
  """max |got - want| / max |want| (float32 math)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want), initial=0.0)
               / max(float(np.max(np.abs(want), initial=0.0)), 1e-30))


def check_against_ragged_dot(lhs, rhs, sizes, backends, options=None) -> dict[str, dict]:
  """Max relative error of out, d_lhs, d_rhs per backend vs ragged_dot (f32 math)."""
  options = options or {}
  cot = jax.random.normal(jax.random.PRNGKey(1), (lhs.shape[0], rhs.shape[2]), jnp.float32)

  def run(name):
    kw = options.get(name, {})
    f = jax.jit(lambda a, b: jax.vjp(lambda a, b: gmm_lib.gmm(
        a, b, sizes, backend=name, preferred_element_type=jnp.float32, **kw), a, b))
    out, vjp = f(lhs, rhs)
    return (out,) + tuple(vjp(cot))

  try:
    ref = [np.asarray(a, np.float32) for a in run("ragged_dot")]
  except Exception as e:  # noqa: BLE001 - e.g. ragged_dot out of memory on CPU
    logging.warning("no correctness check: ragged_dot failed: %s", e)
    return {}
  errs = {}
  for name in backends:
    try:
      got = ref if name == "ragged_dot" else run(name)
    except Exception as e:  # noqa: BLE001
      errs[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
      continue
    errs[name] = {k: rel_err(g, r) for k, g, r in zip(("out", "d_lhs", "d_rhs"), got, ref)}
  return errs
