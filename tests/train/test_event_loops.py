"""moejax.train.event_loops: a late TensorStore callback to a closed orbax loop is quiet."""

from __future__ import annotations

import asyncio
import sys
import threading
import types

from moejax.train import event_loops


def _late_callback_report(loop) -> types.SimpleNamespace:
  """What TensorStore's thread hands ``sys.unraisablehook`` when a write finishes after
  orbax closed the loop its callback targets."""
  caught = []

  def finish_write():
    try:
      loop.call_soon_threadsafe(lambda: None)
    except RuntimeError as e:
      caught.append(e)
  thread = threading.Thread(target=finish_write)
  thread.start()
  thread.join()
  (error,) = caught
  return types.SimpleNamespace(exc_type=type(error), exc_value=error,
                               exc_traceback=error.__traceback__, err_msg=None, object=None)


def _reports_passed_on(monkeypatch) -> list:
  passed = []
  monkeypatch.setitem(event_loops._previous_hook, "hook", passed.append)  # pylint: disable=protected-access
  return passed


def test_a_callback_to_a_drained_loop_after_it_closed_is_not_printed(monkeypatch):
  passed = _reports_passed_on(monkeypatch)
  loop = event_loops.DrainingPolicy().new_event_loop()
  loop.close()
  report = _late_callback_report(loop)
  assert event_loops.is_late_callback(report)
  event_loops.quiet_unraisable(report)
  assert passed == []


def test_the_same_report_from_a_loop_it_did_not_close_still_prints(monkeypatch):
  passed = _reports_passed_on(monkeypatch)
  loop = asyncio.DefaultEventLoopPolicy().new_event_loop()
  loop.close()
  report = _late_callback_report(loop)
  event_loops.quiet_unraisable(report)
  other = types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError("boom"),
                                exc_traceback=None, err_msg=None, object=None)
  event_loops.quiet_unraisable(other)
  assert passed == [report, other]


def test_draining_installs_the_quiet_hook_over_the_current_one_and_keeps_it(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  monkeypatch.setitem(event_loops._previous_hook, "hook", sys.__unraisablehook__)  # pylint: disable=protected-access
  with event_loops.draining_event_loops():
    assert sys.unraisablehook is event_loops.quiet_unraisable
  assert sys.unraisablehook is event_loops.quiet_unraisable  # a late callback comes after close
  other = types.SimpleNamespace(exc_type=KeyError, exc_value=KeyError("x"), exc_traceback=None,
                                err_msg=None, object=None)
  sys.unraisablehook(other)
  assert seen == [other]
