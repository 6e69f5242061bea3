"""Domain labels of Python source: exact byte ranges on hand-written snippets."""

import os

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from moejax.data import labels as L
from moejax.data import stdlib

C, M, D, S = L.CODE, L.COMMENT, L.DOCSTRING, L.STRING


def spans_of(pieces):
  """Expected [(begin, end, label)] in bytes from (text, label) pieces."""
  out, pos = [], 0
  for text, label in pieces:
    n = len(text.encode("utf-8"))
    out.append((pos, pos + n, label))
    pos += n
  return out


def test_hand_numbered_line():
  data, labels = L.label_python_source("x = 'a'  # c\n")
  assert data == b"x = 'a'  # c\n"
  assert L.label_spans(labels) == [(0, 4, C), (4, 7, S), (7, 9, C), (9, 12, M), (12, 13, C)]


def test_known_module_every_domain():
  pieces = [
      ('"""Modulé doc."""', D), ("\nimport os  ", C), ("# why é", M), ("\nX = ", C),
      ('b"raw"', S), (" + ", C), ('f"{os.sep}λ!"', S), ("\n\nclass A:\n    ", C),
      ("'Class doc.'", D), ("\n    def f(self):\n        ", C), ('r"""Method doc."""', D),
      ("\n        s = ", C), ('"not doc"', S), ("  ", C), ("# trailing", M),
      ("\n        return s\nasync def g():\n    ", C), ('"""Async doc."""', D), ("\n    ", C),
      ('"second statement: a string"', S), ("\ndef h():\n    x = 1\n    ", C),
      ('"not first: a string"', S), ("\nif X:\n    ", C), ('"if body: no docstring"', S),
      ("\n", C),
  ]
  src = "".join(p for p, _ in pieces)
  data, labels = L.label_python_source(src)
  assert data == src.encode("utf-8")
  assert L.label_spans(labels) == spans_of(pieces)


def test_concatenated_docstring_keeps_inner_comment():
  data, labels = L.label_python_source('def k():\n    ("a"  # c\n     "b")\n')
  assert L.label_spans(labels) == [(0, 14, C), (14, 19, D), (19, 22, M), (22, 31, D), (31, 33, C)]
  assert data[14:31] == b'"a"  # c\n     "b"'


def test_bytes_first_statement_is_a_string_not_a_docstring():
  _, labels = L.label_python_source('b"not a docstring"\n')
  assert L.label_spans(labels) == [(0, 18, S), (18, 19, C)]


def test_crlf_and_multiline_string_offsets():
  pieces = [("x = ", C), ('"""a\r\nb"""', S), ("  ", C), ("# c", M), ("\r\ny = 1\r\n", C)]
  _, labels = L.label_python_source("".join(p for p, _ in pieces))
  assert L.label_spans(labels) == spans_of(pieces)


@pytest.mark.parametrize("src", ["def f(:\n", "x = '''unterminated\n", "\tif x:\n  y\n"])
def test_invalid_source_raises(src):
  with pytest.raises(L.LabelError):
    L.label_python_source(src)


def test_decode_source_honours_coding_and_bom():
  assert L.decode_source("# -*- coding: latin-1 -*-\nx = 'é'\n".encode("latin-1")).endswith("'é'\n")
  assert L.decode_source(b"\xef\xbb\xbfx = 1\n") == "x = 1\n"
  with pytest.raises(L.LabelError):
    L.decode_source(b"x = '\xff'\n")


def _check_span_shapes(data, labels):
  assert labels.shape == (len(data),)
  for b, e, k in L.label_spans(labels):
    text = data[b:e]
    if k == M:
      assert text.startswith(b"#") and b"\n" not in text
    elif k == S:
      assert text.rstrip().endswith((b"'", b'"')), text[-20:]


_STDLIB_FILES = stdlib.list_source_files(stdlib.stdlib_dir())[:40]


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(st.sampled_from(_STDLIB_FILES))
def test_real_stdlib_files_label_consistently(rel):
  with open(os.path.join(stdlib.stdlib_dir(), rel), "rb") as f:
    data, labels = L.label_python_source(L.decode_source(f.read()))
  _check_span_shapes(data, labels)


names = st.sampled_from(["a", "b1", "x_y"])
literals = st.sampled_from(["'s'", '"t"', "'''u\nv'''", "rb'\\d'", 'f"{a}"', "'é'"])
comments = st.sampled_from(["# c", "#", "# é ü"])


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(st.lists(st.tuples(names, literals, st.one_of(st.none(), comments)),
                           min_size=1, max_size=6))
def test_generated_assignments(lines):
  """Each line ``name = literal  # comment``: exact spans by construction."""
  pieces = []
  for name, lit, comment in lines:
    pieces += [(f"{name} = ", C), (lit, S)]
    if comment is not None:
      pieces += [("  ", C), (comment, M)]
    pieces.append(("\n", C))
  src = "".join(p for p, _ in pieces)
  _, labels = L.label_python_source(src)
  expected = np.concatenate([np.full(len(t.encode()), k, np.uint8) for t, k in pieces])
  np.testing.assert_array_equal(labels, expected)
