"""Corpus fingerprint: which data a result was measured on.

The embedded default corpus is the running interpreter's standard library
(:mod:`moejax.data.stdlib`), so a user on another Python version trains and
evaluates on other documents, and their numbers are not comparable with ours.
Every ablation result records :func:`corpus_fingerprint` of its data config,
and ``experiments.compare`` and the ablation runner flag results whose
fingerprints differ (:func:`mismatches`).

A fingerprint is a small JSON-able dict:

- ``dataset``: the dataset name; ``config``: the builder config name
  (``py3.11.7`` for the stdlib corpus: the Python version is in it);
  ``version``: the builder / TFDS dataset version;
- ``python_version``: the Python whose stdlib was read (the dataset's own
  record when it has one, else the running interpreter);
- ``tokenizer``: ``DataConfig.tokenizer`` (``bytes`` when the config has no
  such field);
- ``content_sha256``: SHA-256 over the train and eval splits as the pipeline
  reads them: per split its name and document count, then every document's
  tokens and labels in stored order. Datasets larger than ``max_bytes`` are
  hashed over their first ``max_bytes`` of documents per split, and
  ``hashed_docs`` says how many;
- ``id``: a one-line summary ``dataset/config:version tokenizer sha256[:12]``;
  two fingerprints with equal ``id`` are the same corpus.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from typing import Mapping, Optional

FIELDS = ("dataset", "config", "version", "python_version", "tokenizer")
DEFAULT_MAX_BYTES = 1 << 30


def documents_sha256(splits: Mapping[str, object], max_bytes: int = DEFAULT_MAX_BYTES):
  """(hex SHA-256, {split: documents hashed}) of ``{split: Documents}`` (see module doc)."""
  h = hashlib.sha256()
  hashed = {}
  for split, docs in splits.items():
    h.update(f"{split}\0{len(docs)}\0".encode())
    seen, n = 0, 0
    for doc in docs:
      if seen >= max_bytes:
        break
      tokens = doc.tokens.tobytes()
      h.update(len(tokens).to_bytes(8, "little") + tokens + doc.labels.tobytes())
      seen, n = seen + len(tokens), n + 1
    hashed[split] = n
  return h.hexdigest(), hashed


def fingerprint_of(splits: Mapping[str, object], tokenizer: str = "bytes",
                   max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
  """The fingerprint of ``{split: Documents}`` (the first split's metadata names the corpus)."""
  first = next(iter(splits.values()))
  meta = dict(first.metadata or {})
  digest, hashed = documents_sha256(splits, max_bytes)
  fp = {"dataset": first.name, "config": meta.get("config"),
        "version": meta.get("version", meta.get("builder_version")),
        "python_version": meta.get("python_version", platform.python_version()),
        "tokenizer": tokenizer, "content_sha256": digest,
        "documents": {s: len(d) for s, d in splits.items()}}
  if any(hashed[s] < len(d) for s, d in splits.items()):
    fp["hashed_docs"] = hashed
  fp["id"] = fingerprint_id(fp)
  return fp


def fingerprint_id(fp: Mapping) -> str:
  name = fp["dataset"] + (f"/{fp['config']}" if fp.get("config") else "")
  name += f":{fp['version']}" if fp.get("version") else ""
  return f"{name} {fp.get('tokenizer', 'bytes')} sha256:{fp['content_sha256'][:12]}"


@functools.lru_cache(maxsize=8)
def corpus_fingerprint(cfg, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
  """The fingerprint of the train and eval splits that DataConfig ``cfg`` reads.

  Reads every document once (the stdlib corpus: ~0.1 s); cached per config.
  """
  from moejax import data as data_lib  # pylint: disable=g-import-not-at-top
  splits = {s: data_lib.load_documents(cfg, s) for s in (cfg.train_split, cfg.eval_split)}
  fp = fingerprint_of(splits, getattr(cfg, "tokenizer", "bytes"), max_bytes)
  if fp["version"] is None and cfg.name in data_lib.BUILTIN_DATASETS:
    fp["version"] = str(data_lib.BUILTIN_DATASETS[cfg.name].VERSION)
    fp["id"] = fingerprint_id(fp)
  return fp


def mismatches(fingerprints: Mapping[str, Optional[Mapping]]) -> list[str]:
  """Lines naming every field on which the labelled fingerprints differ.

  A label whose fingerprint is None (a result written before fingerprints
  were recorded) is named as unknown. No lines: one corpus.
  """
  known = {k: v for k, v in fingerprints.items() if v}
  out = []
  unknown = sorted(k for k, v in fingerprints.items() if not v)
  if unknown and known:
    out.append(f"corpus unknown (no fingerprint recorded) for {', '.join(unknown)}")
  ids: dict[str, list[str]] = {}
  for label, fp in known.items():
    ids.setdefault(fp["id"], []).append(label)
  if len(ids) > 1:
    parts = [f"{i} ({', '.join(labels)})" for i, labels in ids.items()]
    fields = [f for f in FIELDS + ("content_sha256",)
              if len({str(fp.get(f)) for fp in known.values()}) > 1]
    out.append(f"corpora differ ({', '.join(fields)}): " + "; ".join(parts))
  return out
