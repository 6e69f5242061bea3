r"""Checkpoint interop parity (``--suite=interop``): imported layers against transformers.

Usage:
  python -m experiments.bench --suite=interop --json_out=results/bench/interop.json

For every case of :data:`moejax.interop.parity.CASES` (each family's routing
rules: top-K with and without renormalisation, shared experts, group limits),
random transformers MoE blocks (``--interop_seeds``) on ``--interop_tokens``
ties-free tokens, float32 on CPU: the largest output error of the imported
moejax layer against the transformers block, absolute and relative to the
block's largest output, the largest gate error, and whether every token got
the same experts. Needs the interop extra (``pip install -e '.[interop]'``).
"""

from __future__ import annotations

from absl import flags

from experiments.benchmarks import lib as bench_lib
from experiments.benchmarks import registry

_SEEDS = flags.DEFINE_list("interop_seeds", ["0", "1", "2"], "--suite=interop: block seeds")
_TOKENS = flags.DEFINE_list("interop_tokens", ["1", "9", "48"], "--suite=interop: token counts")


def run() -> dict:
  conditions = bench_lib.conditions()
  try:
    # pylint: disable=g-import-not-at-top
    import torch
    import transformers
    from moejax.interop import parity
  except ImportError as e:
    raise bench_lib.BenchFailed(f"--suite=interop needs the interop extra ({e}); install it "
                                "with pip install -e '.[interop]'") from e
  torch.use_deterministic_algorithms(True)
  conditions.update(torch=torch.__version__, transformers=transformers.__version__)
  seeds, tokens = [int(s) for s in _SEEDS.value], [int(t) for t in _TOKENS.value]
  cases = {}
  for name, model_type, overrides, options in parity.CASES:
    rows = []
    try:
      for seed in seeds:
        for t in tokens:
          got = parity.block_parity(model_type, seed, t, options, **overrides)
          rows.append({k: got[k] for k in ("same_experts", "gate_error", "max_abs", "max_rel")})
    except Exception as e:  # pylint: disable=broad-except
      cases[name] = {"family": model_type, "error": bench_lib.variant_failed(name, e)}
      continue
    gates = [r["gate_error"] for r in rows if r["gate_error"] is not None]
    cases[name] = {"family": model_type, "overrides": overrides, "blocks": len(rows),
                   "same_experts": all(r["same_experts"] for r in rows),
                   "gate_error": max(gates) if gates else None,
                   "max_abs": max(r["max_abs"] for r in rows),
                   "max_rel": max(r["max_rel"] for r in rows)}
    bench_lib.progress(f"{name}: max abs error {cases[name]['max_abs']:.1e}")
  return {"cases": cases, "seeds": seeds, "tokens": tokens, "conditions": conditions}


def markdown(res: dict) -> str:
  c = res["conditions"]
  lines = [f"Seeds {', '.join(map(str, res['seeds']))} x {', '.join(map(str, res['tokens']))} "
           f"tokens per case, float32 on CPU, transformers {c.get('transformers', '?')}, "
           f"torch {c.get('torch', '?')}:", "",
           "| case | family | same experts | gate error | max abs error | max relative error |",
           "|---|---|---|---:|---:|---:|"]
  for name, r in res["cases"].items():
    if "error" in r:
      lines.append(f"| {name} | {r['family']} | failed: {r['error'][:100]} | | | |")
      continue
    gate = "-" if r["gate_error"] is None else f"{r['gate_error']:.1e}"
    lines.append(f"| {name} | {r['family']} | {'yes' if r['same_experts'] else '**no**'} | "
                 f"{gate} | {r['max_abs']:.1e} | {r['max_rel']:.1e} |")
  return "\n".join(lines) + "\n"


def show(res: dict) -> None:
  print(markdown(res))


SUITE = registry.register(registry.Suite(
    "interop", "imported MoE layers against the transformers blocks (needs the interop extra)",
    run, show))
