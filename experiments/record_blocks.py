"""The generated blocks of docs/benchmarks.md, rendered from the committed result records.

``python -m experiments.bench_record`` rewrites them (``--check``: exit 1
when one is stale); this module defines no flags, so a test can render
without importing a binary. A block is the text between two markers; the opening one names a record
under ``results/`` and what to render from it::

    <!-- moejax:record device/h200.json gmm_timing -->
    ... (regenerated) ...
    <!-- moejax:end record -->

What can be rendered (:data:`KINDS`): ``provenance`` (the command and the
machine the record carries, "not recorded" where it has none, and the
record's path, which holds the date and the commit),
``summary`` (each step's status), the device check's ``gmm_timing``,
``gather``, ``layer`` and ``train`` tables, the layer, grouped-matmul and
training-step, scaling, profile and expert-parallel benches' tables
(``layer_bench``, ``gmm_bench``, ``step_twin``, ``scaling_bench``,
``profile_bench``, ``ep_bench``, ``train_runs``,
``step_profile``, ``tests_run``, ``interop_bench``; results/bench/), and the serving bench's and the
quantisation tables (results/serving/). Everything outside the blocks
is hand-written: short notes on what the numbers show.
tests/test_bench_record.py checks that the committed file is its render.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
RESULTS = os.path.join(ROOT, "results")
BLOCK = re.compile(r"(<!-- moejax:record (?P<path>\S+) (?P<kind>\w+) -->\n)(?P<body>.*?)"
                   r"(<!-- moejax:end record -->)", re.S)


class RecordError(ValueError):
  """A block names a record or a kind that does not exist."""


def _ms(r: Mapping) -> str:
  return f"{1e3 * r['median_s']:.2f}" if "median_s" in r else _failed(r)


def _failed(r: Mapping) -> str:
  error = r.get("error", "no result")
  return f"failed: {error if len(error) <= 100 else error[:100] + '...'}"


def provenance(rec: Mapping) -> str:
  steps = rec.get("steps")  # the device check's steps (a bench's "steps" is a count)
  env = steps.get("environment", {}) if isinstance(steps, Mapping) else {}
  command = rec.get("command") or (
      "python -m experiments.device_check " + " ".join(env.get("argv", [])[1:])).strip()
  machine = rec.get("machine") or (
      f"{len(env['devices'])} x {env['device_kind']}, {env['cpu_count']} CPU cores, "
      f"JAX {env['jax']}, flax {env.get('flax_version', 'not recorded')}, Python "
      f"{env['python']}" if "device_kind" in env else "not recorded")
  note = f"- note: {rec['note']}\n" if rec.get("note") else ""
  # The date and the commit stay in the record: the rendered file carries what a reader
  # reruns (the command) and where it ran, not when.
  return (f"- command: `{command}`\n- machine: {machine}\n"
          f"- date and commit: in `{rec['record']}`\n{note}")


def summary(rec: Mapping) -> str:
  steps = ", ".join(f"{name} {status}" for name, status in rec.get("summary", {}).items())
  return f"Steps: {steps or 'none'}.\n"


def gmm_timing(rec: Mapping) -> str:
  g = rec["steps"]["gmm_timing"]
  lines = [f"m={g['m']} k={g['k']} n={g['n']} G={g['groups']}, {g['dtype']}, median of the "
           "timed runs:", "",
           "| variant | fwd ms | fwd TFLOP/s | of dense | fwd+bwd ms |", "|---|---:|---:|---:|---:|"]
  for name, row in g["variants"].items():
    fwd, bwd = row.get("fwd", {}), row.get("fwdbwd")
    cells = ([_ms(fwd), f"{fwd['tflops']:.0f}", f"{fwd['fraction_of_dense']:.2f}"]
             if "median_s" in fwd else [_failed(fwd), "", ""])
    lines.append(f"| `{name}` | {' | '.join(cells)} | {_ms(bwd) if bwd else '-'} |")
  target = g.get("target")
  if target:
    lines += ["", f"Target ({target['what']}): {'met' if target['met'] else 'not met'}; best "
              f"`{target['best_variant']}` at {target['fraction_of_dense']:.2f} of dense."]
  return "\n".join(lines) + "\n"


def gather(rec: Mapping) -> str:
  g = rec["steps"]["gather"]
  lines = [f"T={g['T']} K={g['K']} d={g['d']} ({g['rows']} rows):", "",
           "| variant | ms | GB/s |", "|---|---:|---:|"]
  for name, r in g["variants"].items():
    lines.append(f"| `{name}` | {_ms(r)} | {r['gb_per_s']:.0f} |" if "median_s" in r
                 else f"| `{name}` | {_failed(r)} | |")
  exact = ", ".join(f"{k} {'exact' if v is True else v}" for k, v in g["exact"].items())
  return "\n".join(lines) + f"\n\nAgainst XLA's take: {exact}.\n"


def _ratio(r) -> str:
  if not r or "ratio_to_dense" not in r:
    return _failed(r or {})
  return f"{r['ratio_to_dense']:.2f}"


def layer(rec: Mapping) -> str:
  out = []
  for shape, s in rec["steps"]["layer"].items():
    if not isinstance(s, Mapping) or "variants" not in s:
      continue
    dense = s["variants"].get("dense", {})
    out += [f"{shape}: T={s['T']} d={s['d']} E={s['E']} K={s['K']} f={s['f']}, {s['dtype']}; "
            "time as a ratio to the dense FFN of equal active FLOPs:", "",
            "| path | fwd | fwd+bwd |", "|---|---:|---:|"]
    for name, row in s["variants"].items():
      fwd, bwd = _ratio(row.get("fwd")), _ratio(row.get("fwdbwd"))
      if name == "dense":
        fwd = f"1.00 ({_ms(dense['fwd'])} ms)" if "median_s" in dense.get("fwd", {}) else fwd
        bwd = (f"1.00 ({_ms(dense['fwdbwd'])} ms)" if "median_s" in dense.get("fwdbwd", {})
               else bwd)
      out.append(f"| `{name}` | {fwd} | {bwd} |")
    out.append("")
  return "\n".join(out)


def layer_bench(rec: Mapping) -> str:
  """``experiments.bench --suite=layer``'s record: per shape, each variant's medians and its
  ratio to its own dense FFN (JAX rows to JAX's, torch rows to torch's)."""
  out = []
  for shape, s in rec["shapes"].items():
    out += [f"{shape}: T={s['T']} d={s['d']} E={s['E']} K={s['K']} f={s['f']} (dense width "
            f"{s['dense_width']}, {s['fwd_gflop']:.1f} GFLOP forward); auto runs "
            f"`{s['auto']['backend']}` here:", "",
            "| variant | fwd s | x dense | fwd+bwd s | **fwd+bwd x dense** | same, CPU time |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, row in s["variants"].items():
      cells = []
      for mode in ("fwd", "fwdbwd"):
        r = row.get(mode, {})
        cells += ([f"{r['median_s']:.3f}", _ratio(r)] if "median_s" in r
                  else [_failed(r), ""])
      cpu = row.get("fwdbwd", {}).get("cpu_ratio_to_dense")
      cells.append("-" if cpu is None else f"{cpu:.2f}")
      out.append(f"| `{name}` | " + " | ".join(cells) + " |")
    for name, why in s.get("skipped", {}).items():
      out.append(f"| `{name}` | skipped: {why} | | | | |")
    out.append("")
  return "\n".join(out)


def rel_errors(err: Mapping) -> str:
  """A gmm bench row's errors against ragged_dot (out, d_lhs, d_rhs), as the table prints
  them (experiments/benchmarks/gmm.py's too)."""
  return ", ".join(f"{v:.1e}" if isinstance(v, float) else str(v) for v in err.values())


def gmm_bench(rec: Mapping) -> str:
  """``experiments.bench --suite=gmm``'s record: each backend's median, rate, ratio to the
  dense matmul of the same FLOPs, and its error against ragged_dot."""
  lines = [f"m={rec['m']} k={rec['k']} n={rec['n']} G={rec['groups']}, {rec['dtype']}:", "",
           "| variant | median s | TFLOP/s | x dense | rel err (out, d_lhs, d_rhs) |",
           "|---|---:|---:|---:|---|"]
  for name, r in rec["results"].items():
    err = r.get("max_rel_err_vs_ragged_dot")
    err_s = rel_errors(err) if err else ("reference" if name == "ragged_dot" else "")
    lines.append(f"| `{name}` | {r['median_s']:.4g} | {r['tflops']:.3f} | "
                 f"{r['fraction_of_dense']:.2f} | {err_s} |")
  for name, r in rec.get("failed", {}).items():
    lines.append(f"| `{name}` | {_failed(r) if 'error' in r else 'refused: ' + r['refused']} "
                 "| | | |")
  for name, why in rec.get("skipped", {}).items():
    lines.append(f"| `{name}` | skipped: {why} | | | |")
  return "\n".join(lines) + "\n"


def train(rec: Mapping) -> str:
  lines = ["| model | params | batch x seq | tokens/s | MFU of the bf16 peak |",
           "|---|---:|---|---:|---:|"]
  for name, r in rec["steps"]["train"].items():
    if not isinstance(r, Mapping):
      continue  # the step's status and seconds
    if not r.get("trained"):
      lines.append(f"| {name} | {_failed(r) if 'error' in r else 'not trained'} | | | |")
      continue
    mfu = "n/a" if r["mfu_vs_peak_bf16"] is None else f"{100 * r['mfu_vs_peak_bf16']:.1f}%"
    lines.append(f"| {name} | {r['params'] / 1e6:.1f}M | {r['batch']} x {r['seq_len']} | "
                 f"{r['tokens_per_s'] / 1e3:.0f}k | {mfu} |")
  return "\n".join(lines) + "\n"


def step_twin(rec: Mapping) -> str:
  """``experiments.bench --suite=step --step_twin``'s record: as the bench prints it."""
  from experiments.benchmarks import twin  # pylint: disable=g-import-not-at-top
  return twin.twin_markdown(rec) + "\n"


def scaling_bench(rec: Mapping) -> str:
  """``experiments.bench --suite=scaling``'s record: one table per sweep and mode."""
  from experiments.benchmarks import scaling  # pylint: disable=g-import-not-at-top
  return scaling.markdown_tables(rec) + "\n"


def profile_bench(rec: Mapping) -> str:
  """``experiments.bench --suite=profile``'s record: the wall split per kind of work."""
  from experiments.benchmarks import profile  # pylint: disable=g-import-not-at-top
  sp = rec["spec"]
  return (f"{sp['mode']}, K={sp['k']}, f={sp['f']}, d={sp['d']}, float32, {rec['cores']} "
          "cores; each cell is the variant's wall ms / the dense FFN's in one traced call, "
          "and in parentheses that difference over dense's call:\n\n"
          + profile.markdown_tables(rec) + "\n")


def ep_bench(rec: Mapping) -> str:
  """``experiments.bench --suite=ep``'s record: the tables as the suite prints them."""
  from experiments.benchmarks import ep  # pylint: disable=g-import-not-at-top
  return "```\n" + ep.table_text(rec).strip("\n") + "\n```\n"


def step_profile(rec: Mapping) -> str:
  """``experiments.bench --suite=step``'s record: one step of a suite arm by part."""
  from experiments.benchmarks import step  # pylint: disable=g-import-not-at-top
  return step.step_markdown(rec)


def interop_bench(rec: Mapping) -> str:
  """``experiments.bench --suite=interop``'s record: each case's errors against transformers."""
  from experiments.benchmarks import interop  # pylint: disable=g-import-not-at-top
  return interop.markdown(rec)


def tests_run(rec: Mapping) -> str:
  """``experiments.bench --suite=tests``'s record: the default test run's time and memory."""
  from experiments.benchmarks import tests as tests_bench  # pylint: disable=g-import-not-at-top
  return tests_bench.markdown(rec)


def train_runs(rec: Mapping) -> str:
  """``experiments.bench --suite=train``'s record: cost and reached losses of each run."""
  from experiments.benchmarks import train as train_bench  # pylint: disable=g-import-not-at-top
  return train_bench.markdown(rec)


def _load_line(rec: Mapping) -> str:
  before = rec["conditions"].get("load_avg_1_5_15")
  after = (rec.get("conditions_after") or {}).get("load_avg_1_5_15")
  fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
  return ("" if before is None else f"; load average (1, 5, 15 min) {fmt(before)} at the start"
          + ("" if after is None else f" and {fmt(after)} at the end"))


def serving_bench(rec: Mapping) -> str:
  """The serving bench's conditions line and tables."""
  from experiments.benchmarks import serving  # pylint: disable=g-import-not-at-top
  c = rec["conditions"]
  return (f"Conditions: {c['platform']} ({c.get('processor', '?')}, {c['cpu_count']} cores), "
          f"jax {c['jax']}, Python {c['python']}{_load_line(rec)}.\n\n"
          + serving.markdown_tables(rec) + "\n")


def _quantization(part: str) -> Callable[[Mapping], str]:
  def render_part(rec: Mapping) -> str:
    from experiments import serving_tables  # pylint: disable=g-import-not-at-top
    return serving_tables.quantization_table(rec[part]) + "\n"
  return render_part


KINDS: dict[str, Callable[[Mapping], str]] = {
    "provenance": provenance, "summary": summary, "gmm_timing": gmm_timing,
    "gather": gather, "layer": layer, "layer_bench": layer_bench, "gmm_bench": gmm_bench,
    "train": train, "step_twin": step_twin, "scaling_bench": scaling_bench,
    "profile_bench": profile_bench, "ep_bench": ep_bench, "train_runs": train_runs,
    "step_profile": step_profile, "tests_run": tests_run,
    "interop_bench": interop_bench,
    "serving_bench": serving_bench,
    "quantization_moejax": _quantization("moejax"), "quantization_hf": _quantization("hf")}


def load(path: str, results: str = RESULTS) -> dict:
  full = os.path.join(results, path)
  if not os.path.isfile(full):
    raise RecordError(f"a block names results/{path}, which does not exist. Fix: correct the "
                      "path in the marker, or commit the record")
  with open(full, encoding="utf-8") as fh:
    return json.load(fh)


def render(text: str, results: str = RESULTS) -> str:
  """``text`` with every record block regenerated from ``results``."""
  def block(m):
    kind = m.group("kind")
    if kind not in KINDS:
      raise RecordError(f"a block asks for {kind!r}; use one of {', '.join(KINDS)}")
    try:
      # ``record``: the file's path, which the provenance block names.
      body = KINDS[kind](dict(load(m.group("path"), results),
                              record=f"results/{m.group('path')}"))
    except KeyError as e:
      raise RecordError(f"results/{m.group('path')} has no {e} for a {kind} block. Fix: "
                        "pick a kind its steps recorded") from e
    return m.group(1) + body + m.group(5)
  return BLOCK.sub(block, text)
