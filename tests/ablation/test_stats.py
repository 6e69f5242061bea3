"""Ablation statistics on tiny hand-computed inputs (t quantiles from printed tables)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from moejax.ablation import stats

T_975_2 = 4.302653   # t_{0.975, 2 df}, any t table
T_975_4 = 2.776445   # t_{0.975, 4 df}


def test_t_interval_by_hand_and_against_scipy():
  iv = stats.t_interval([1.0, 2.0, 3.0])
  # mean 2, sd 1, half-width 4.302653 / sqrt(3) = 2.484138
  assert (iv.mean, iv.n, iv.sd) == (2.0, 3, 1.0)
  assert iv.lo == pytest.approx(2 - 2.484138, abs=1e-6)
  assert iv.hi == pytest.approx(2 + 2.484138, abs=1e-6)
  x = np.random.default_rng(0).normal(size=7)
  ci = scipy.stats.ttest_1samp(x, 0.0).confidence_interval(0.95)
  iv = stats.t_interval(x)
  assert (iv.lo, iv.hi) == pytest.approx((ci.low, ci.high), abs=1e-12)
  assert stats.t_quantile(2) == pytest.approx(T_975_2, abs=1e-6)


def test_one_seed_has_no_interval_and_is_unresolved():
  iv = stats.t_interval([2.5])
  assert (iv.mean, iv.lo, iv.hi, iv.half_width) == (2.5, None, None, None)
  assert stats.verdict(iv) == "unresolved"
  assert stats.reason(iv) == "no interval over seeds (1 seed)"


def test_known_paired_difference_is_better_and_null_is_unresolved():
  base = {0: 2.10, 1: 2.27, 2: 2.13}
  arm = {0: 2.00, 1: 2.15, 2: 2.05}          # d = -0.10, -0.12, -0.08
  iv, seeds = stats.paired(arm, base)
  assert seeds == [0, 1, 2]
  # mean -0.10, sd 0.02, half-width 4.302653 * 0.02 / sqrt(3) = 0.049683
  assert iv.mean == pytest.approx(-0.10)
  assert iv.sd == pytest.approx(0.02)
  assert (iv.lo, iv.hi) == pytest.approx((-0.149683, -0.050317), abs=1e-6)
  assert stats.verdict(iv) == "better"                      # lower is better (a loss)
  assert stats.verdict(iv, direction=1) == "worse"          # higher is better
  assert stats.verdict(iv, direction=0) == "lower"          # no preferred direction
  flipped, _ = stats.paired(base, arm)
  assert stats.verdict(flipped) == "worse"
  null, _ = stats.paired({0: 2.11, 1: 2.26, 2: 2.13}, base)  # d = 0.01, -0.01, 0
  assert null.lo < 0 < null.hi and stats.verdict(null) == "unresolved"
  assert stats.reason(null) == "the seed interval includes 0"


def test_paired_uses_common_seeds_only():
  iv, seeds = stats.paired({0: 1.0, 1: 2.0, 2: 4.0}, {1: 1.0, 2: 2.0, 3: 9.0})
  assert seeds == [1, 2] and iv.mean == pytest.approx(1.5) and iv.n == 2
  with pytest.raises(ValueError, match="no common seed"):
    stats.paired({0: 1.0}, {1: 1.0})


def test_welch_matches_scipy_and_needs_two_each():
  a, b = [1.0, 2.0, 3.0, 4.0], [0.0, 0.5, 1.0]
  iv = stats.welch(a, b)
  ci = scipy.stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
  assert iv.mean == pytest.approx(2.0) and (iv.lo, iv.hi) == pytest.approx((ci.low, ci.high))
  assert stats.welch([1.0], b).lo is None


def test_bootstrap_exact_on_two_documents():
  # Differences 0 and 2 over one token each: a resample draws {0,0}, {0,2} or {2,2},
  # D in {0, 1, 2} with probability 1/4, 1/2, 1/4, so the 2.5% / 97.5% percentiles are 0 and 2.
  iv = stats.document_bootstrap([0.0, 2.0], [1.0, 1.0])
  assert (iv.mean, iv.lo, iv.hi, iv.n) == (1.0, 0.0, 2.0, 2)
  assert stats.verdict(iv) == "unresolved"  # the interval touches 0


def test_bootstrap_known_difference_resolves_and_null_does_not():
  counts = [10.0, 20.0, 10.0, 40.0, 0.0]     # the empty document is dropped
  known = stats.document_bootstrap([0.5, 1.5, 1.0, 2.0, 0.0], counts)
  assert known.mean == pytest.approx(5.0 / 80.0) and known.n == 4
  assert 0 < known.lo <= known.mean <= known.hi and stats.verdict(known) == "worse"
  # Every document's difference equals the mean: no spread, the interval is a point.
  same = stats.document_bootstrap([1.0, 2.0, 4.0], [1.0, 2.0, 4.0])
  assert (same.lo, same.hi) == pytest.approx((1.0, 1.0))
  null = stats.document_bootstrap([1.0, -1.0, 1.0, -1.0, 0.5, -0.5], [1.0] * 6)
  assert null.mean == 0.0 and null.lo < 0 < null.hi
  assert stats.document_bootstrap([3.0], [2.0]).lo is None  # one document: no interval


def test_combined_verdict_needs_both_intervals_on_one_side():
  seed = stats.Interval(-0.1, -0.15, -0.05, 3, 0.02)
  doc_yes = stats.Interval(-0.1, -0.12, -0.08, 21)
  doc_no = stats.Interval(-0.1, -0.2, 0.01, 21)
  doc_flip = stats.Interval(0.1, 0.05, 0.15, 21)
  assert stats.verdict(seed, doc_yes) == "better"
  assert stats.verdict(seed, doc_no) == "unresolved"
  assert stats.reason(seed, doc_no) == "the document interval includes 0"
  assert stats.verdict(seed, doc_flip) == "unresolved"
  assert "disagree" in stats.reason(seed, doc_flip)


def test_pooled_mdd_by_hand():
  # Paired sds 0.02 and 0.04 at 3 seeds: s_p^2 = (2 * 0.02^2 + 2 * 0.04^2) / 4 = 0.001,
  # MDD = t_{0.975, 4} sqrt(0.001) / sqrt(3).
  diffs = [stats.Interval(0.0, -1.0, 1.0, 3, 0.02), stats.Interval(0.0, -1.0, 1.0, 3, 0.04)]
  assert stats.pooled_mdd(diffs, 3) == pytest.approx(T_975_4 * math.sqrt(0.001) / math.sqrt(3),
                                                     abs=1e-6)
  # One arm alone: its MDD is its own half-width.
  own = stats.t_interval([-0.10, -0.12, -0.08])
  assert stats.pooled_mdd([own], 3) == pytest.approx(own.half_width)
  assert stats.pooled_mdd([stats.Interval(0.1, None, None, 1)], 1) is None


def test_interval_round_trips_through_a_dict():
  iv = stats.t_interval([1.0, 2.0])
  assert stats.Interval.from_dict(iv.as_dict()) == iv
