"""Corpus fingerprints: exact hash format, what changes it, the stdlib's Python, mismatches."""

import hashlib
import platform


from moejax import data
from moejax.data import Documents, fingerprint


def _docs(texts, labels=None, split="train"):
  return Documents.from_arrays(texts, labels=labels, domain_names=("a", "b"), split=split)


def test_hash_is_the_documented_byte_stream():
  train, val = _docs([b"ab", b""]), _docs([b"c"], labels=[[1]], split="validation")
  fp = fingerprint.fingerprint_of({"train": train, "validation": val})
  h = hashlib.sha256()
  h.update(b"train\x002\x00")
  h.update((2).to_bytes(8, "little") + b"ab" + b"\0\0")
  h.update((0).to_bytes(8, "little"))
  h.update(b"validation\x001\x00")
  h.update((1).to_bytes(8, "little") + b"c" + b"\1")
  assert fp["content_sha256"] == h.hexdigest()
  assert fp["dataset"] == "in_memory" and fp["tokenizer"] == "bytes"
  assert fp["python_version"] == platform.python_version()  # no record: the running one
  assert fp["documents"] == {"train": 2, "validation": 1} and "hashed_docs" not in fp
  assert fp["id"] == f"in_memory bytes sha256:{h.hexdigest()[:12]}"


def test_any_byte_label_order_or_tokenizer_change_changes_the_fingerprint():
  base = fingerprint.fingerprint_of({"train": _docs([b"ab", b"cd"])})
  for other in ({"train": _docs([b"ab", b"ce"])},                       # one byte
                {"train": _docs([b"ab", b"cd"], labels=[[0, 0], [0, 1]])},  # one label
                {"train": _docs([b"cd", b"ab"])},                       # order
                {"train": _docs([b"abc", b"d"])}):                      # boundaries
    assert fingerprint.fingerprint_of(other)["id"] != base["id"]
  bpe = fingerprint.fingerprint_of({"train": _docs([b"ab", b"cd"])}, tokenizer="bpe")
  assert bpe["content_sha256"] == base["content_sha256"] and bpe["id"] != base["id"]


def test_large_corpora_hash_a_stated_prefix():
  docs = _docs([b"x" * 10] * 5)
  fp = fingerprint.fingerprint_of({"train": docs}, max_bytes=25)
  assert fp["hashed_docs"] == {"train": 3}  # stops once 25 bytes are hashed
  assert fp["content_sha256"] != fingerprint.fingerprint_of({"train": docs})["content_sha256"]


def test_stdlib_corpus_records_its_python(tmp_path):
  cfg = data.DataConfig(data_dir=str(tmp_path), stdlib_max_files=6, stdlib_val_fraction=0.3)
  fp = fingerprint.corpus_fingerprint(cfg)
  assert fp["dataset"] == "python_stdlib" and fp["version"] == "1.0.0"
  assert fp["python_version"] == platform.python_version()
  assert fp["config"].startswith(f"py{platform.python_version()}")
  assert fp["id"].startswith(f"python_stdlib/{fp['config']}:1.0.0 bytes sha256:")
  assert sum(fp["documents"].values()) == 6
  other = fingerprint.corpus_fingerprint(
      data.DataConfig(data_dir=str(tmp_path), stdlib_max_files=7, stdlib_val_fraction=0.3))
  assert other["content_sha256"] != fp["content_sha256"]


def test_mismatches_name_the_fields_and_the_unknown():
  a = fingerprint.fingerprint_of({"train": _docs([b"ab"])})
  b = dict(a, python_version="3.12.0", content_sha256="f" * 64)
  b["id"] = fingerprint.fingerprint_id(b)
  assert fingerprint.mismatches({"x": a, "y": dict(a)}) == []
  lines = fingerprint.mismatches({"x": a, "y": b, "z": None})
  assert lines[0] == "corpus unknown (no fingerprint recorded) for z"
  assert lines[1].startswith("corpora differ (python_version, content_sha256): ")
  assert "(x)" in lines[1] and "(y)" in lines[1]
  assert fingerprint.mismatches({"x": None}) == []  # nothing known: nothing to compare
