r"""Statistics of ablation answers: intervals over seeds, paired differences, a document
bootstrap, computed verdicts.

Legend: n seeds, N validation documents, R bootstrap resamples, a an arm,
b the suite's baseline arm, x_s the value of a metric in the run of seed s.

**Interval over seeds** (per arm and metric; :func:`t_interval`): the mean
m = (1/n) sum_s x_s, the standard deviation s = sqrt(sum_s (x_s - m)^2 / (n - 1))
and the Student t interval m +- h with half-width

    h = t_{0.975, n-1} * s / sqrt(n).

With one seed there is no interval (``lo`` = ``hi`` = None).

**Paired difference** (arm vs baseline; :func:`paired`): every arm trains
once per seed with the same ``train.seed`` and the same data order, so the
runs of one seed share their initialisation stream and their batches. The
difference is taken per seed, d_s = x_s(a) - x_s(b), over the seeds both arms
ran, and its t interval is the interval above applied to d_s. Pairing removes
what the two runs of a seed have in common; the interval is what is left.

**Document bootstrap** (validation loss only; :func:`document_bootstrap`):
the final whole-split evaluation stores, per validation document i, the
cross-entropy sum L_i and its target count c_i (the same in both arms: same
split). With L_i averaged over the paired seeds, the split's loss difference
is the ratio

    D = sum_i (L_i(a) - L_i(b)) / sum_i c_i        (nats per token)

and resampling the N documents with replacement (R = 2000 times, seed 0,
paired: a document's two losses move together) gives the 95% percentile
interval of D. It answers "do these models differ on this kind of data?",
not "would another seed reproduce it?": a difference that the bootstrap
resolves but the seed interval does not is real for these weights and may
still be one seed's luck.

**Verdict** (:func:`verdict`): for a metric where lower is better (loss,
MaxVio, drop rate) ``better`` when the whole interval of the difference
lies below zero, ``worse`` when it lies above, ``unresolved`` otherwise,
including when there is no interval (fewer than two paired seeds). For the
validation loss both intervals, over seeds and over documents, must exclude
zero on the same side. A metric without a preferred direction (the
specialisation MI) reads ``higher`` / ``lower`` / ``unresolved``.

**Minimal detectable difference** (MDD; :func:`pooled_mdd`): the half-width
of the paired interval, t_{0.975, n-1} s_d / sqrt(n): an observed mean
difference smaller than it cannot exclude zero at this spread, so a true
difference of exactly the MDD is resolved about half the time (for 80%
power, roughly 1.4 x MDD at large n). A suite's MDD for a metric pools the
variance of the paired differences over its non-baseline arms,
s_p^2 = sum_a (n_a - 1) s_a^2 / sum_a (n_a - 1), with t at sum_a (n_a - 1)
degrees of freedom and n the suite's seed count. It shrinks like 1/sqrt(n):
four times the seeds halve it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence

import numpy as np
import scipy.stats

LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0

# Verdict words by direction: -1 lower is better, +1 higher is better, 0 none.
_WORDS = {-1: ("better", "worse"), 1: ("worse", "better"), 0: ("lower", "higher")}
UNRESOLVED = "unresolved"


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean and its interval; ``lo`` / ``hi`` None when there is none (n < 2)."""

  mean: float
  lo: Optional[float]
  hi: Optional[float]
  n: int
  sd: Optional[float] = None

  @property
  def half_width(self) -> Optional[float]:
    return None if self.lo is None else (self.hi - self.lo) / 2

  def excludes_zero(self) -> bool:
    return self.lo is not None and (self.lo > 0 or self.hi < 0)

  def as_dict(self) -> dict:
    return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n, "sd": self.sd}

  @classmethod
  def from_dict(cls, d: Mapping) -> "Interval":
    return cls(d["mean"], d.get("lo"), d.get("hi"), d["n"], d.get("sd"))


def t_quantile(df: int, level: float = LEVEL) -> float:
  """t_{(1+level)/2, df}: 4.303 for df = 2 at 95%."""
  return float(scipy.stats.t.ppf((1 + level) / 2, df))


def t_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
  """Mean and Student t interval of ``values`` (see the module doc)."""
  x = np.asarray(values, np.float64)
  if x.size == 0:
    raise ValueError("t_interval of no values")
  m = float(x.mean())
  if x.size < 2:
    return Interval(m, None, None, int(x.size))
  sd = float(x.std(ddof=1))
  h = t_quantile(x.size - 1, level) * sd / math.sqrt(x.size)
  return Interval(m, m - h, m + h, int(x.size), sd)


def paired(arm: Mapping[int, float], base: Mapping[int, float],
           level: float = LEVEL) -> tuple[Interval, list[int]]:
  """(t interval of arm - base over the seeds both have, those seeds)."""
  seeds = sorted(set(arm) & set(base))
  if not seeds:
    raise ValueError(f"no common seed: arm has {sorted(arm)}, baseline {sorted(base)}")
  return t_interval([arm[s] - base[s] for s in seeds], level), seeds


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
  """Unpaired (Welch) interval of mean(a) - mean(b): for runs that share no seed."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  m = float(a.mean() - b.mean())
  if a.size < 2 or b.size < 2:
    return Interval(m, None, None, int(min(a.size, b.size)))
  ci = scipy.stats.ttest_ind(a, b, equal_var=False).confidence_interval(level)
  return Interval(m, float(ci.low), float(ci.high), int(min(a.size, b.size)))


def document_bootstrap(diff_sums: Sequence[float], counts: Sequence[float],
                       level: float = LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> Interval:
  """Percentile interval of D = sum(diff_sums) / sum(counts) over documents resampled.

  Args:
    diff_sums: f[N] per-document loss sum of the arm minus the baseline's.
    counts: f[N] per-document target counts.
  ``n`` of the result is N; fewer than two scored documents give no interval.
  """
  d = np.asarray(diff_sums, np.float64)
  c = np.asarray(counts, np.float64)
  if d.shape != c.shape or d.ndim != 1:
    raise ValueError(f"diff_sums {d.shape} and counts {c.shape} must be equal 1-D shapes")
  keep = c > 0  # an empty document is never drawn into the ratio
  d, c = d[keep], c[keep]
  if c.size == 0:
    raise ValueError("document_bootstrap: no document has a scored target")
  mean = float(d.sum() / c.sum())
  if c.size < 2:
    return Interval(mean, None, None, int(c.size))
  res = scipy.stats.bootstrap(
      (d, c), lambda dd, cc, axis=-1: dd.sum(axis) / cc.sum(axis), paired=True,
      vectorized=True, n_resamples=resamples, confidence_level=level, method="percentile",
      rng=np.random.default_rng(seed))
  ci = res.confidence_interval
  return Interval(mean, float(ci.low), float(ci.high), int(c.size))


def verdict(*intervals: Optional[Interval], direction: int = -1) -> str:
  """``better`` / ``worse`` (or ``lower`` / ``higher``) when every interval excludes zero on
  the same side, else ``unresolved``; see the module doc."""
  given = [iv for iv in intervals if iv is not None]
  if not given or not all(iv.excludes_zero() for iv in given):
    return UNRESOLVED
  signs = {iv.hi < 0 for iv in given}
  if len(signs) > 1:
    return UNRESOLVED
  below, above = _WORDS[direction]
  return below if signs.pop() else above


def pooled_mdd(diffs: Sequence[Interval], n: int, level: float = LEVEL) -> Optional[float]:
  """The suite's MDD at ``n`` seeds from its paired differences (see the module doc).

  None when no difference has two seeds (no spread to pool).
  """
  parts = [(iv.n - 1, iv.sd) for iv in diffs if iv.sd is not None and iv.n >= 2]
  df = sum(k for k, _ in parts)
  if df == 0 or n < 2:
    return None
  sp = math.sqrt(sum(k * sd * sd for k, sd in parts) / df)
  return t_quantile(df, level) * sp / math.sqrt(n)


def reason(iv: Optional[Interval], boot: Optional[Interval] = None) -> str:
  """Why a comparison is unresolved, in words (empty when it is resolved)."""
  if iv is None or iv.lo is None:
    n = iv.n if iv else 0
    return f"no interval over seeds ({n} seed{'' if n == 1 else 's'})"
  out = []
  if not iv.excludes_zero():
    out.append("the seed interval includes 0")
  if boot is not None and boot.lo is not None and not boot.excludes_zero():
    out.append("the document interval includes 0")
  if boot is not None and iv.excludes_zero() and boot.excludes_zero() and (
      (iv.hi < 0) != (boot.hi < 0)):
    out.append("the seed and document intervals disagree in sign")
  return "; ".join(out)
