r"""``--suite=layer``: the routed-expert layer against a dense FFN and its peers.

  python -m experiments.bench --suite=layer --json_out=/tmp/layer.json

Times, side by side in one process, forward and forward+backward of
  (a) ``dense``: a SwiGLU FFN of width K*f (the same active FLOPs per token),
  (b) ``routed_experts`` with every grouped-matmul backend that runs natively
      here (``blocked`` = the fused default, ``blocked_unfused`` = permute +
      3 gmm + unpermute, ``blocked_folded`` = 3 gmm with the gather and the
      combine folded into their row loads and stores); Pallas backends off
      their platform would only run interpreted and are listed as skipped,
  (b') ``expert_matmuls``: the experts' three matmuls alone on rows already
      grouped by expert, M / E each (``bench_lib.expert_matmuls``): what XLA's
      matmuls at the experts' shapes cost without routing, sort, gather or combine,
  (c) ``gshard``: GShard one-hot einsum dispatch/combine, capacity factor
      ``--capacity_factor`` per group of ``--gshard_group`` tokens,
  (d) ``ragged_dot``: routed_experts with ``jax.lax.ragged_dot``,
  (e) the peer, when the ``interop`` extra (torch, transformers) is installed:
      ``torch_dense`` (the same dense SwiGLU FFN in PyTorch) and
      ``hf_mixtral`` (Hugging Face transformers' MixtralSparseMoeBlock, its
      default per-expert loop) and ``hf_mixtral_grouped_mm`` (the same block
      with ``experts_implementation='grouped_mm'``; ``--hf_impls`` picks
      the implementations), with ``torch.set_num_threads``
      = ``--torch_threads`` (default: the CPU count, as XLA:CPU uses),
at T=8192, d=512 for the ``fine`` shape (E=64, K=8, f=256) and the ``coarse``
shape (E=8, K=2, f=1024). JAX variants are compared with ``dense``, torch
variants with ``torch_dense``: the MoE / dense ratio of each framework,
measured side by side in one process. Routing comes from a fixed random router
(Gaussian logits, top-K, softmax over the K) and is computed outside the timed
functions; the backward pass differentiates params, x and the gate weights.
Repeats run round-robin over the variants so that load from other processes
hits them alike; medians are reported. A variant whose first run exceeds
``--slow_s`` gets ``--slow_repeats`` timed runs instead.

On CPU, ragged_dot runs as a dense product over every group, whose memory
grows with E x T x d (tens of GB at the fine shape): its variants are compiled
first and refused in one line, not run, when XLA's estimate of their memory
exceeds what the machine has available.
"""

from __future__ import annotations

import os
import textwrap

from absl import app, flags

from experiments.benchmarks import common
from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import registry

_SHAPES = flags.DEFINE_list("shapes", ["fine", "coarse"], "layer shapes to run")
_TOKENS = flags.DEFINE_integer("tokens", 8192, "T for the layer suite")
_D_MODEL = flags.DEFINE_integer("d_model", 512, "d for the layer suite")
_VARIANTS = flags.DEFINE_list("variants", None, "subset of layer variants (default all)")
_TILE_M = flags.DEFINE_integer("tile_m", None, "row tile of the blocked backend")
_TILE_SMALL = flags.DEFINE_integer("tile_small", None, "remainder tile of the blocked backend")
_CF = flags.DEFINE_float("capacity_factor", 1.25, "GShard capacity factor")
_GSHARD_GROUP = flags.DEFINE_integer("gshard_group", 1024, "GShard tokens per group")
_HF_IMPLS = flags.DEFINE_list("hf_impls", ["eager", "grouped_mm"],
                              "MixtralSparseMoeBlock experts_implementation values to time")

TORCH_BASE, JAX_BASE = "torch_dense", "dense"
# The table's width: a row's reason (skipped, failed, refused) continues on indented lines.
WIDTH = 100
NAME_W = 22  # the variant column


def jax_variants(run: list[str], opts: dict, capacity_factor: float, group: int) -> dict:
  """{variant name: routed_experts options} of the JAX rows, given the native backends
  ``run`` and the blocked backend's tile ``opts``."""
  variants = {"dense": None, "expert_matmuls": None}
  if "blocked" in run:
    variants["blocked"] = dict(backend="blocked", **opts)
    variants["blocked_unfused"] = dict(backend="blocked", fused=False, fold_permute=False,
                                       **opts)
    variants["blocked_folded"] = dict(backend="blocked", fused=False, **opts)
  variants.update({name: dict(backend=name) for name in run
                   if name not in ("blocked", "ragged_dot")})
  variants["gshard"] = dict(capacity_factor=capacity_factor, group=group)
  if "ragged_dot" in run:
    variants["ragged_dot"] = dict(backend="ragged_dot")
  return variants


def _one_shape(shape: str, run: list[str], skipped: dict, keep) -> dict:
  t, d = _TOKENS.value, _D_MODEL.value
  opts = {key: flag.value for key, flag in (("tile_m", _TILE_M), ("tile_small", _TILE_SMALL))
          if flag.value is not None}
  e, k, f = (bench_lib.SHAPES[shape][n] for n in ("num_experts", "k", "f"))
  prob = bench_lib.layer_problem(t, d, e, k, f, seed=common.SEED.value)
  variants = jax_variants(run, opts, _CF.value, _GSHARD_GROUP.value)
  fns = bench_lib.jax_layer_fns(prob, {n: v for n, v in variants.items() if keep(n)})
  torch_fns = bench_lib.torch_layer_fns(prob, common.TORCH_THREADS.value,
                                        tuple(_HF_IMPLS.value))
  torch_note = torch_fns.pop("_skipped", None)
  fns.update({n: fn for n, fn in torch_fns.items() if keep(n.split("/")[0])})
  auto = bench_lib.auto_decision(t, d, e, k, f)
  print(f"{shape}: T={t} d={d} E={e} K={k} f={f}, {len(fns)} runs; auto runs "
        f"{auto['backend']}", flush=True)
  print(textwrap.fill(auto["line"], width=100, initial_indent="  ",
                      subsequent_indent="    "), flush=True)
  timed = bench_lib.time_round_robin(common.forced_failures(fns), common.repeats(),
                                     common.SLOW_S.value, common.SLOW_REPEATS.value)
  table = bench_lib.split_modes(timed)
  torch_names = {n.split("/")[0] for n in torch_fns}
  jax_rows = {n: r for n, r in table.items() if n not in torch_names}
  torch_rows = {n: r for n, r in table.items() if n in torch_names}
  bench_lib.ratios_to(jax_rows, JAX_BASE)
  bench_lib.ratios_to(torch_rows, TORCH_BASE)
  for rows, base in ((jax_rows, JAX_BASE), (torch_rows, TORCH_BASE)):
    for row in rows.values():  # one key for the printer: the ratio to its own dense
      for mode in row.values():
        if f"ratio_to_{base}" in mode:
          mode["ratio_to_dense"] = mode[f"ratio_to_{base}"]
          mode["cpu_ratio_to_dense"] = mode[f"cpu_ratio_to_{base}"]
  return {"T": t, "d": d, "E": e, "K": k, "f": f, "dense_width": k * f,
          "fwd_gflop": bench_lib.layer_fwd_flops(prob) / 1e9, "capacity_factor": _CF.value,
          "gshard_group": _GSHARD_GROUP.value, "tiles": opts,
          "torch_threads": common.TORCH_THREADS.value if torch_fns else None,
          "torch_skipped": torch_note, "auto": auto, "variants": table, "skipped": skipped}


def layer_suite() -> dict:
  unknown = set(_SHAPES.value) - set(bench_lib.SHAPES)
  if unknown:
    raise app.UsageError(f"--shapes: unknown {sorted(unknown)}; use {sorted(bench_lib.SHAPES)}")
  run, skipped = bench_lib.native_backends()
  wanted = _VARIANTS.value
  keep = lambda name: not wanted or name in wanted
  out = {"conditions": bench_lib.conditions(), "shapes": {}}
  for shape in _SHAPES.value:
    out["shapes"][shape] = _one_shape(shape, run, skipped, keep)
  out["conditions_after"] = {"load_avg_1_5_15": list(os.getloadavg())}
  return out


def _row_line(name: str, row: dict) -> str:
  cells, notes = [], []
  for mode in ("fwd", "fwdbwd"):
    r = row.get(mode, {})
    if "median_s" in r:
      cells += [f"{r['median_s']:.3f}", f"{r.get('ratio_to_dense', float('nan')):.2f}"]
    else:
      state = "failed" if "error" in r else "refused" if "refused" in r else "-"
      cells += [state, "-"]
      if state != "-":  # an error's first line is cut at 200 characters already
        notes.append(f"{mode}: {r.get('error') or r['refused']}")
  runs = max((r.get("runs", 0) for r in row.values()), default=0)
  cpu = row.get("fwdbwd", {}).get("cpu_ratio_to_dense")
  cpu_s = "-" if cpu is None else f"{cpu:.2f}"
  head = (f"{name:<{NAME_W}}{cells[0]:>10}{cells[1]:>9}{cells[2]:>11}{cells[3]:>9}{cpu_s:>8}"
          f"{runs:>6}")
  return head if not notes else wrapped(f"{head}  (", f"{'; '.join(notes)})", NAME_W + 2)


def wrapped(head: str, text: str, indent: int) -> str:
  """``head`` then ``text``, in lines of at most :data:`WIDTH` columns, the text continued
  ``indent`` columns in (``head`` is kept as it is: its columns stay aligned)."""
  return "\n".join(textwrap.wrap(text, WIDTH, initial_indent=head,
                                  subsequent_indent=" " * indent, break_on_hyphens=False))


def print_layer_table(res: dict) -> None:
  for shape, s in res["shapes"].items():
    print(f"\n{shape}: T={s['T']} d={s['d']} E={s['E']} K={s['K']} f={s['f']} "
          f"(dense width {s['dense_width']}, {s['fwd_gflop']:.1f} GFLOP forward)")
    print("(x dense: JAX variants vs dense, torch ones vs torch_dense; cpu x: the same ratio in "
          "CPU time)")
    if s.get("auto"):
      print(wrapped(f"auto here runs {s['auto']['backend']}: ", s["auto"]["line"], 4))
    print(f"{'variant':<{NAME_W}}{'fwd s':>10}{'x dense':>9}{'fwd+bwd s':>11}{'x dense':>9}"
          f"{'cpu x':>8}{'runs':>6}")
    for name, row in s["variants"].items():
      print(_row_line(name, row))
    skipped = dict(s["skipped"])
    if s.get("torch_skipped"):
      skipped["torch variants"] = s["torch_skipped"]
    for name, why in skipped.items():  # the row names the backend: not its reason again
      why = why.removeprefix(f"gmm backend '{name}': ")
      print(wrapped(f"{name:<{NAME_W}}skipped: ", why, NAME_W + len("skipped: ")))


SUITE = registry.register(registry.Suite(
    "layer", "the routed-expert layer vs a dense FFN, GShard and HF Mixtral",
    layer_suite, print_layer_table))
