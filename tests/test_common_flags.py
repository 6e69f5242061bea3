"""experiments/common_flags.py: each flag the user binaries share is defined once, with one
wording, and belongs to the binary that asks for it (absl's --help lists it there)."""

import inspect
import pathlib
import re

import pytest
from absl import flags

from experiments import common_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = [name for name, fn in inspect.getmembers(common_flags, inspect.isfunction)
          if fn.__module__ == common_flags.__name__ and not name.startswith("_")]
# Generic flags of binaries that tests and notebooks import side by side: defined once per
# process, whichever binary comes first (common_flags._shared).
GENERIC = ["json_out", "repeats", "seed"]
# device_check's --dry_run is another flag of the same name: a hardware check at tiny
# shapes with Pallas kernels interpreted, not "validate and write nothing".
OTHER_MEANING = {("device_check.py", "dry_run")}


def _definitions(flag: str) -> list[str]:
  pattern = re.compile(r"\bDEFINE_\w+(\(\s*|,\s*)\"" + flag + "\"")
  return sorted(str(p.relative_to(ROOT / "experiments"))
                for p in (ROOT / "experiments").rglob("*.py")
                if pattern.search(p.read_text(encoding="utf-8"))
                and (p.name, flag) not in OTHER_MEANING)


def test_the_shared_flags_are_the_ones_the_binaries_had_in_common():
  assert sorted(SHARED) == sorted(["dry_run", "extend", "print_config", "step",
                                   "take_over_lock", *GENERIC])


@pytest.mark.parametrize("flag", sorted(SHARED))
def test_each_shared_flag_is_defined_in_exactly_one_place(flag):
  assert _definitions(flag) == ["common_flags.py"]


def test_the_binaries_ask_for_the_shared_flags_they_have():
  def asks(binary):
    src = (ROOT / "experiments" / f"{binary}.py").read_text(encoding="utf-8")
    return sorted(set(re.findall(r"\bcommon_flags\.(\w+)\(", src)))
  assert asks("train") == ["dry_run", "extend", "print_config", "take_over_lock"]
  assert asks("ablate") == ["dry_run", "extend", "print_config", "take_over_lock"]
  assert asks("finetune") == ["dry_run", "print_config", "take_over_lock"]
  assert asks("generate") == ["seed", "step"] and asks("export_hf") == ["step"]
  assert asks("bench") == ["json_out"] and asks("device_check") == ["json_out", "repeats"]


def test_a_generic_flag_is_defined_once_for_binaries_imported_side_by_side():
  fv = flags.FlagValues()
  first, second = common_flags.seed(fv), common_flags.seed(fv)
  fv(["prog", "--seed=3"])
  assert first.value == second.value == 3


def test_a_shared_flag_is_a_key_flag_of_the_module_that_defines_it():
  fv = flags.FlagValues()
  holder = common_flags.dry_run(fv)
  step = common_flags.step(fv)
  fv(["prog", "--dry_run", "--step=7"])
  assert (holder.value, step.value) == (True, 7)
  key = {f.name for f in fv.get_key_flags_for_module(__name__)}
  assert key == {"dry_run", "step"}  # listed under this module by --help, not common_flags
  assert not fv.get_key_flags_for_module(common_flags.__name__)
  with pytest.raises(flags.DuplicateFlagError):
    common_flags.dry_run(fv)  # one definition per binary
