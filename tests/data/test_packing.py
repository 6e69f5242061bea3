"""Packing: exact rows on a hand-made corpus, determinism, exact resume."""

import json

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from moejax import data
from moejax.data import Documents

A, B, Cc, D, E, F = (ord(c) for c in "abcdef")


def tiny():
  """Docs 'ab' (domain 1), 'cde' (domain 2), 'f' (domain 3)."""
  return Documents.from_arrays([b"ab", b"cde", b"f"], labels=[[1, 1], [2, 2, 2], [3]],
                               domain_names=("zero", "one", "two", "three"))


def test_validation_rows_exact():
  # Stream: 0 a b 0 c d e 0 f (T = 9); rows of S + 1 = 4 tokens, stride 3.
  it = data.make_batch_iterator(tiny(), seq_len=3, batch_size=2, train=False)
  assert len(it) == 2
  b0, b1 = list(it)
  np.testing.assert_array_equal(b0["inputs"], [[0, A, B], [0, Cc, D]])
  np.testing.assert_array_equal(b0["targets"], [[A, B, 0], [Cc, D, E]])
  np.testing.assert_array_equal(b0["labels"], [[1, 1, 2], [2, 2, 2]])
  np.testing.assert_array_equal(b0["segment_ids"], [[1, 1, 1], [1, 1, 1]])
  # The target 0 before 'cde' opens document 1 (like its label).
  np.testing.assert_array_equal(b0["doc_ids"], [[0, 0, 1], [1, 1, 1]])
  assert b0["mask"].all()
  np.testing.assert_array_equal(b1["inputs"], [[E, 0, F], [0, 0, 0]])
  np.testing.assert_array_equal(b1["targets"], [[0, F, 0], [0, 0, 0]])
  np.testing.assert_array_equal(b1["labels"][0, :2], [3, 3])
  np.testing.assert_array_equal(b1["segment_ids"], [[1, 2, 2], [0, 0, 0]])
  np.testing.assert_array_equal(b1["mask"], [[True, True, False], [False] * 3])
  np.testing.assert_array_equal(b1["doc_ids"], [[2, 2, -1], [-1, -1, -1]])
  with pytest.raises(StopIteration):
    next(it)


def test_train_lanes_exact():
  # T = 9, B = 2: lanes of L = 4 tokens, (L - 1) // S = 1 batch per epoch.
  docs = tiny()
  it = data.make_batch_iterator(docs, seq_len=3, batch_size=2, seed=7)
  assert len(it) == 1
  for epoch in range(3):
    order = np.random.default_rng(np.random.SeedSequence([7, epoch])).permutation(3)
    stream = np.concatenate([np.r_[0, docs[i].tokens] for i in order])
    batch = next(it)
    np.testing.assert_array_equal(batch["inputs"], [stream[0:3], stream[4:7]])
    np.testing.assert_array_equal(batch["targets"], [stream[1:4], stream[5:8]])
    assert batch["mask"].all() and it.epoch == epoch


def reference_batches(docs, S, B, seed, train, n):
  """Straight numpy slicing of the concatenated stream; no doc bookkeeping."""
  out, epoch = [], 0
  while len(out) < n:
    order = (np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(len(docs))
             if train else np.arange(len(docs)))
    stream = np.concatenate([np.r_[0, docs[i].tokens] for i in order]).astype(np.int32)
    # A separator takes the first label of its document (0 if it is empty).
    labels = np.concatenate([np.r_[docs[i].labels[:1] if len(docs[i].labels) else [0],
                                   docs[i].labels] for i in order]).astype(np.int32)
    doc_of = np.concatenate([np.full(len(docs[i].tokens) + 1, i) for i in order])
    if train:
      L = len(stream) // B
      starts = [[b * L + k * S for b in range(B)] for k in range((L - 1) // S)]
    else:
      rows = list(range(0, len(stream) - 1, S))
      starts = [rows[k:k + B] for k in range(0, len(rows), B)]
    for batch in starts:
      pad = lambda x: np.pad(x, (0, S + 1 - len(x)))
      batch = batch + [len(stream)] * (B - len(batch))  # padding rows: past the end
      windows = np.stack([pad(stream[s:s + S + 1]) for s in batch])
      lab = np.stack([pad(labels[s:s + S + 1]) for s in batch])
      doc = np.stack([pad(doc_of[s:s + S + 1]) for s in batch])
      out.append({"inputs": windows[:, :-1], "targets": windows[:, 1:], "labels": lab[:, 1:],
                  "doc_ids": doc[:, 1:]})
    if not train:
      break
    epoch += 1
  return out[:n]


doc_lists = st.lists(st.binary(min_size=0, max_size=30).map(lambda b: b.replace(b"\0", b"x")),
                     min_size=1, max_size=8)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(doc_lists, st.integers(1, 7), st.integers(1, 3), st.integers(0, 3), st.booleans())
def test_matches_reference_slicing(raw, S, B, seed, train):
  labels = [np.arange(len(r)) % 3 for r in raw]
  docs = Documents.from_arrays(raw, labels=labels, domain_names=("x", "y", "z"))
  T = sum(len(r) + 1 for r in raw)
  hypothesis.assume(not train or T // B >= S + 1)
  want = reference_batches(docs, S, B, seed, train, n=7 if train else 10**6)
  it = data.make_batch_iterator(docs, S, B, seed=seed, train=train)
  got = [next(it) for _ in range(len(want))]
  for g, w in zip(got, want):
    valid = g["mask"]
    for key in ("inputs", "targets", "labels", "doc_ids"):
      np.testing.assert_array_equal(np.where(valid, g[key], -1), np.where(valid, w[key], -1))
    assert (g["doc_ids"][~valid] == -1).all()
  if not train:
    assert sum(int(g["mask"].sum()) for g in got) == T - 1  # every target exactly once
    # Per document: every byte and the separator that opens it, except the first separator.
    scored = [np.zeros(0, int)] + [g["doc_ids"][g["mask"]] for g in got]
    per_doc = np.bincount(np.concatenate(scored), minlength=len(raw))
    np.testing.assert_array_equal(per_doc, [len(r) + (i > 0) for i, r in enumerate(raw)])
    with pytest.raises(StopIteration):
      next(it)


def corpus():
  rng = np.random.default_rng(0)
  raw = [rng.integers(1, 256, size=int(rng.integers(0, 90))) for _ in range(25)]
  return Documents.from_arrays(raw, labels=[np.full(len(r), i % 4) for i, r in enumerate(raw)],
                               domain_names=tuple("abcd"))


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_same(xs, ys):
  assert len(xs) == len(ys)
  for x, y in zip(xs, ys):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_deterministic_given_seed_and_seed_matters():
  a = take(data.make_batch_iterator(corpus(), 16, 4, seed=1), 30)
  b = take(data.make_batch_iterator(corpus(), 16, 4, seed=1), 30)
  c = take(data.make_batch_iterator(corpus(), 16, 4, seed=2), 30)
  assert_same(a, b)
  assert any((x["inputs"] != y["inputs"]).any() for x, y in zip(a, c))


def test_epochs_are_permutations_and_differ():
  docs = corpus()
  it = data.make_batch_iterator(docs, 8, 2, seed=3)
  orders = [it._epoch_order(e)[0].copy() for e in range(3)]
  for o in orders:
    assert sorted(o) == list(range(len(docs)))
  assert not (orders[0] == orders[1]).all()


def test_save_restore_gives_identical_batches():
  it = data.make_batch_iterator(corpus(), 16, 4, seed=1)
  take(it, 23)  # crosses epoch boundaries
  state = json.loads(json.dumps(it.get_state()))
  assert state["epoch"] >= 1
  after = take(it, 20)
  resumed = data.make_batch_iterator(corpus(), 16, 4, seed=1, state=state)
  assert_same(after, take(resumed, 20))


def test_restore_refuses_another_stream():
  state = data.make_batch_iterator(corpus(), 16, 4, seed=1).get_state()
  with pytest.raises(ValueError, match="seed=1 but this iterator has seed=2"):
    data.make_batch_iterator(corpus(), 16, 4, seed=2, state=state)
  with pytest.raises(ValueError, match="seq_len"):
    data.make_batch_iterator(corpus(), 8, 4, seed=1, state=state)


def test_processes_split_the_global_batch():
  full = take(data.make_batch_iterator(corpus(), 8, 4, seed=5), 6)
  parts = [take(data.make_batch_iterator(corpus(), 8, 4, seed=5, process_index=p, process_count=2), 6)
           for p in range(2)]
  for k, batch in enumerate(full):
    for key in batch:
      np.testing.assert_array_equal(batch[key],
                                    np.concatenate([parts[0][k][key], parts[1][k][key]]))


def test_bad_arguments_fail_early():
  with pytest.raises(ValueError, match="fewer than batch_size"):
    data.make_batch_iterator(tiny(), seq_len=8, batch_size=4)
  with pytest.raises(ValueError, match="process_count"):
    data.make_batch_iterator(corpus(), 8, 3, process_count=2)
  with pytest.raises(ValueError, match="labels"):
    Documents.from_arrays([b"ab"], labels=[[0]])


def test_state_round_trips_through_orbax(tmp_path):
  import orbax.checkpoint as ocp
  it = data.make_batch_iterator(corpus(), 16, 4, seed=1)
  take(it, 9)
  with ocp.CheckpointManager(str(tmp_path)) as mngr:
    mngr.save(9, args=ocp.args.Composite(data=ocp.args.JsonSave(it.get_state())))
    mngr.wait_until_finished()
  with ocp.CheckpointManager(str(tmp_path)) as mngr:
    state = mngr.restore(9, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
  assert_same(take(it, 5), take(data.make_batch_iterator(corpus(), 16, 4, seed=1, state=state), 5))


def test_unigram_baseline_and_domain_fractions():
  train = Documents.from_arrays([b"ab"], labels=[[0, 1]], domain_names=("p", "q"))
  # Train stream 0 a b: add-one over 256 bytes gives p(0)=p(a)=p(b)=2/259.
  evaluation = Documents.from_arrays([b"a", b"zz"])
  # Eval stream 0 a 0 z z: three seen tokens at 2/259, two unseen z at 1/259.
  want = -(3 * np.log(2 / 259) + 2 * np.log(1 / 259)) / 5
  assert data.unigram_cross_entropy(train, evaluation) == pytest.approx(want)
  assert data.domain_fractions(train) == {"p": 0.5, "q": 0.5}
