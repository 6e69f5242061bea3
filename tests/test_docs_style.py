"""README.md and the docs/ guides speak of the code, in short sentences.

A guide says what a command does and what it prints; the measurements
behind a claim (with their date, commit and machine) live in generated or
marked records: RESULTS.md, results/, and the docs files listed in
``RECORDS``, each marked as a record on its first line. So a guide, and
the README, must carry no date (YYYY-MM-DD) and no commit reference (a
7-40 digit hex hash); the README stays a quick start (at most
``README_MAX_LINES`` lines, prose sentences under ``MAX_MEAN_WORDS`` words
on average), and the docs/ guides together stay under ``GUIDES_MAX_LINES``.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# docs/ files that are records of measurements, not guides (exempt from the
# date and hash rule; each must say so on its first line).
RECORDS = {"benchmarks.md"}
RECORD_MARK = "<!-- moejax:record"
README_MAX_LINES = 150
MAX_MEAN_WORDS = 25
# Half of the 4,519 lines docs/ held as investigation logs and tables; a new guide
# fits by saying less elsewhere, and a measurement goes to a record.
GUIDES_MAX_LINES = 2259

DATE = re.compile(r"(?<![\d-])\d{4}-\d{2}-\d{2}(?![\d-])")
# A hex token of 7-40 characters with at least one digit and one letter a-f:
# a (short or full) commit hash. Words (no digit), numbers (no letter),
# version strings and arXiv ids (dots) do not match.
HASH = re.compile(r"(?<![\w.:/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])")


def guides() -> list[pathlib.Path]:
  return [README] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in RECORDS)


def dated_lines(text: str) -> list[str]:
  """The lines of ``text`` that carry a date or a commit hash, with what matched."""
  out = []
  for number, line in enumerate(text.splitlines(), 1):
    found = DATE.findall(line) + HASH.findall(line)
    if found:
      out.append(f"line {number}: {', '.join(found)}: {line.strip()[:100]}")
  return out


def prose_sentences(text: str) -> list[str]:
  """The sentences of ``text``'s prose: code blocks, tables, headings, images
  and HTML comments left out; each paragraph and list item split at a
  sentence end (., ! or ? before a capital, a backtick or a bracket)."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
  paragraphs, current = [], []
  for line in text.splitlines() + [""]:
    stripped = line.strip()
    new_item = re.match(r"^([-*]|\d+\.)\s", stripped)
    if (not stripped or stripped.startswith(("|", "#", "![")) or new_item) and current:
      paragraphs.append(" ".join(current))
      current = []
    if stripped and not stripped.startswith(("|", "#", "![")):
      current.append(re.sub(r"^([-*]|\d+\.)\s+", "", stripped))
  sentences = []
  for paragraph in paragraphs:
    sentences += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`*\[(])", paragraph) if s.strip()]
  return sentences


def mean_words(sentences: list[str]) -> float:
  return sum(len(s.split()) for s in sentences) / max(len(sentences), 1)


# ---------------------------------------------------------------------------
# The checkers, on hand-made text.

@pytest.mark.parametrize("line, flagged", [
    ("measured 2026-12-03 on 2 cores", True),
    ("at 1a2b3c4, the fused path", True),
    ("commit `dd60cd01b2d9`", True),
    ("code 164fef3 (the morning run)", True),
    ("DeepSeek-V3 (2412.19437) and jax 0.10.2", False),
    ("1887 passed in 10000000 steps", False),
    ("a facade, a decade, deadbeef", False),
    ("`python -m experiments.train --workdir=/tmp/moejax_default`", False),
    ("T = 8192, d = 512, 2025-era models", False),
])
def test_dates_and_hashes_are_found(line, flagged):
  assert bool(dated_lines(line)) == flagged, dated_lines(line)


def test_sentences_skip_code_tables_and_headings():
  text = ("# A heading with many many words in it\n\nOne two three. Four five six seven.\n"
          "Still the second sentence here.\n\n```bash\nnot prose at all here. Really.\n```\n"
          "| a | table | row |\n- a list item\n- another item. With two sentences.\n"
          "<!-- a comment. Two. -->\n![a picture](x.png)\n")
  assert prose_sentences(text) == ["One two three.", "Four five six seven.",
                                   "Still the second sentence here.", "a list item",
                                   "another item.", "With two sentences."]
  assert mean_words(["a b c", "d"]) == 2


# ---------------------------------------------------------------------------
# The repository's README and guides.

@pytest.mark.parametrize("path", guides(), ids=lambda p: str(p.relative_to(ROOT)))
def test_guide_has_no_date_or_commit(path):
  problems = dated_lines(path.read_text(encoding="utf-8"))
  assert not problems, (f"{path.relative_to(ROOT)} is a guide: move dated measurements to a "
                        f"record (docs/{sorted(RECORDS)[0]}) and keep the guide's fact rounded, "
                        "without the date or commit:\n" + "\n".join(problems))


def test_records_are_marked_as_records():
  for name in RECORDS:
    path = ROOT / "docs" / name
    if path.exists():
      first = path.read_text(encoding="utf-8").splitlines()[0]
      assert first.startswith(RECORD_MARK), f"docs/{name}: first line must start {RECORD_MARK!r}"


def test_readme_is_a_quick_start():
  text = README.read_text(encoding="utf-8")
  lines = text.count("\n") + (not text.endswith("\n"))
  assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
  sentences = prose_sentences(text)
  longest = sorted(sentences, key=lambda s: -len(s.split()))[:3]
  assert mean_words(sentences) < MAX_MEAN_WORDS, (
      f"README.md's {len(sentences)} sentences average {mean_words(sentences):.1f} words "
      f"(under {MAX_MEAN_WORDS}); longest: {longest}")


def test_the_guides_stay_short():
  counts = {p.name: p.read_text(encoding="utf-8").count("\n") for p in guides()[1:]}
  assert sum(counts.values()) <= GUIDES_MAX_LINES, (
      f"docs/ guides hold {sum(counts.values())} lines (at most {GUIDES_MAX_LINES}): "
      f"{counts}. Fix: say less, or move measurements to docs/{sorted(RECORDS)[0]}")


# A repository file named in prose (`tests/results/test_report.py`); a part in capitals
# (`results/recheck/ID.json`) is a placeholder.
REPO_PATH = re.compile(r"(?<![\w./-])((?:tests|moejax|experiments|configs|notebooks|results|docs)"
                       r"/[\w/@.+-]*\.(?:py|md|ipynb|json|csv|png))")


def named_paths(text: str) -> list[str]:
  return [p for p in REPO_PATH.findall(text)
          if not any(re.fullmatch(r"[A-Z_]+", part.split(".")[0]) for part in p.split("/"))]


def test_named_paths_skip_placeholders():
  text = "see `tests/results/test_report.py`, results/recheck/ID.json and x/tests/a.py"
  assert named_paths(text) == ["tests/results/test_report.py"]


@pytest.mark.parametrize("path", [README, ROOT / "RESULTS.md", ROOT / "results" / "README.md",
                                  *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_the_files_a_document_names_exist(path):
  missing = [p for p in named_paths(path.read_text(encoding="utf-8")) if not (ROOT / p).exists()]
  assert not missing, f"{path.name} names files that are not in the repository: {missing}"
