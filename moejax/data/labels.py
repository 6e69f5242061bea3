"""Per-byte domain labels for Python source: code, comment, docstring, string.

Legend: L bytes in one document.

The labels feed the expert-specialisation metric (mutual information between
expert choice and domain), so they must be exact and stable:

- ``comment``: a ``#`` comment from the ``#`` to the end of its line, newline
  excluded (``tokenize.COMMENT``).
- ``docstring``: the string statement that opens a module, class or function
  body (``ast.get_docstring``'s rule), from its first quote to its last; the
  whole literal, prefix (``r``, ``b``, ...) included, and, for an implicitly
  concatenated docstring, the whitespace between its parts.
- ``string``: every other string literal, prefix and quotes included. An
  f-string is one literal as a whole, expressions inside the braces included:
  Python 3.12+ tokenizes f-strings into pieces (PEP 701), and we merge them back
  so that the labels agree across Python versions.
- ``code``: everything else (names, operators, numbers, indentation, blank
  lines, the newline after a comment).

Positions: ``tokenize`` reports columns in characters of the decoded line,
``ast`` in UTF-8 bytes of the line; both are mapped to byte offsets into the
UTF-8 encoding of the decoded text, which is what the token ids are.

Source that does not tokenize or parse under the running Python raises
:class:`LabelError`; the corpus builder skips such files (see
``moejax/data/stdlib.py``).
"""

from __future__ import annotations

import ast
import io
import token as token_lib
import tokenize

import numpy as np

CODE, COMMENT, DOCSTRING, STRING = 0, 1, 2, 3
PYTHON_DOMAINS = ("code", "comment", "docstring", "string")

# Token types of the pieces of an f-string (3.12+) or t-string (3.14+); absent
# names simply do not occur on older Pythons.
_OPEN_TYPES = {getattr(token_lib, n) for n in ("FSTRING_START", "TSTRING_START") if hasattr(token_lib, n)}
_CLOSE_TYPES = {getattr(token_lib, n) for n in ("FSTRING_END", "TSTRING_END") if hasattr(token_lib, n)}


class LabelError(ValueError):
  """The source does not tokenize or parse under the running Python."""


def decode_source(data: bytes) -> str:
  """Decodes Python source bytes with its declared (PEP 263) encoding.

  A UTF-8 byte-order mark is dropped, so that the re-encoded text starts with
  the code itself.
  """
  try:
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    text = data.decode(encoding)
  except (SyntaxError, LookupError, UnicodeDecodeError) as e:
    raise LabelError(f"cannot decode source: {e}") from e
  return text[1:] if text.startswith("\ufeff") else text


def _line_starts(lines: list[bytes]) -> list[int]:
  """Byte offset of each line's start; index 0 is a dummy so row r is 1-based."""
  starts = [0, 0]
  for line in lines:
    starts.append(starts[-1] + len(line))
  return starts


def _docstring_nodes(tree: ast.AST) -> list[ast.Constant]:
  """The Constant node of every docstring: first statement of a body, a str."""
  nodes = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
          and isinstance(body[0].value.value, str)):
        nodes.append(body[0].value)
  return nodes


def label_python_source(text: str) -> tuple[bytes, np.ndarray]:
  """Labels every byte of ``text``'s UTF-8 encoding with its domain.

  Args:
    text: decoded Python source (see :func:`decode_source`).

  Returns:
    ``(data, labels)``: ``data`` the UTF-8 bytes (L of them) and ``labels``
    uint8[L] with values CODE, COMMENT, DOCSTRING or STRING.

  Raises:
    LabelError: when the source does not tokenize or parse.
  """
  data = text.encode("utf-8")
  labels = np.full(len(data), CODE, np.uint8)
  # StringIO's default newline='\n' splits lines exactly as tokenize counts
  # them, without translating '\r\n', so byte offsets stay those of `data`.
  str_lines = io.StringIO(text).readlines()
  byte_lines = [line.encode("utf-8") for line in str_lines]
  starts = _line_starts(byte_lines)

  def char_pos(row: int, col: int) -> int:
    if row >= len(starts) - 1:  # ENDMARKER sits one past the last line
      return len(data)
    return starts[row] + len(str_lines[row - 1][:col].encode("utf-8"))

  try:
    tree = ast.parse(text)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
  except (SyntaxError, tokenize.TokenError, ValueError, RecursionError) as e:
    raise LabelError(f"source does not parse: {e}") from e

  depth, fstring_start = 0, 0
  for tok in tokens:
    begin, end = char_pos(*tok.start), char_pos(*tok.end)
    if tok.type in _OPEN_TYPES:
      if depth == 0:
        fstring_start = begin
      depth += 1
    elif tok.type in _CLOSE_TYPES:
      depth -= 1
      if depth == 0:
        labels[fstring_start:end] = STRING
    elif depth == 0 and tok.type == tokenize.STRING:
      labels[begin:end] = STRING
    elif depth == 0 and tok.type == tokenize.COMMENT:
      labels[begin:end] = COMMENT
    if tok.type in (tokenize.STRING, tokenize.COMMENT) and data[begin:end] != tok.string.encode("utf-8"):
      # Positions that do not point at the token's text would mislabel the
      # file silently; refuse it instead.
      raise LabelError(f"token {tok.string[:20]!r} at {tok.start} does not map to its bytes")

  for node in _docstring_nodes(tree):
    begin = starts[node.lineno] + node.col_offset
    end = starts[node.end_lineno] + node.end_col_offset
    # Comments between the parts of a parenthesised, implicitly concatenated
    # docstring stay comments.
    span = labels[begin:end]
    span[span != COMMENT] = DOCSTRING
  return data, labels


def label_spans(labels: np.ndarray) -> list[tuple[int, int, int]]:
  """Run-length form ``[(begin, end, label), ...]`` of uint8[L] labels."""
  labels = np.asarray(labels)
  if labels.size == 0:
    return []
  cuts = np.flatnonzero(np.diff(labels)) + 1
  bounds = np.concatenate([[0], cuts, [labels.size]])
  return [(int(b), int(e), int(labels[b])) for b, e in zip(bounds[:-1], bounds[1:])]
