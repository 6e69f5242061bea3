"""orbax's event loops, drained when closed, and their late reports kept quiet.

orbax (0.12) runs a save's writes and a restore's reads as tasks of a fresh
event loop (in the save's own thread), and when the first of them fails (a
full disk, a damaged checkpoint) it closes that loop with the others still
in flight. Those then report, at some later moment and from other threads,
everything Python cannot raise:

- "Task / Future exception was never retrieved" with the TensorStore error,
  when a finished one is collected;
- "Exception ignored in: <coroutine object ...>" with the whole TensorStore
  spec, when a suspended one is;
- "RuntimeError: Event loop is closed" with its traceback, each time
  TensorStore finishes a write and its callback hands the result to the
  closed loop (``loop.call_soon_threadsafe``, reported through
  ``sys.unraisablehook`` from TensorStore's thread).

While a :class:`moejax.train.checkpoint.Checkpointer` is open (and inside
:func:`draining_event_loops`), a new event loop therefore cancels and
finishes its pending tasks before it closes, so the abandoned writes and
reads end there; the errors of its tasks that nobody retrieved are not
printed when they are a write failure (the trainer reports it in its one
``error:`` line, moejax.train.write_failure); and a TensorStore callback that
still reaches one of these loops after it closed is dropped by
:func:`quiet_unraisable`, which stays installed for the process, because
such a callback may come after the Checkpointer closed. Every other report
prints as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import weakref

from moejax.train import write_errors

# The loops this module closed: a late callback to one of them is no news (see above).
_closed_loops: "weakref.WeakSet[asyncio.AbstractEventLoop]" = weakref.WeakSet()


def _quiet_owned(loop, context: dict) -> None:
  """The loops' exception handler: drops cancellations and write failures, prints the rest."""
  error = context.get("exception")
  if error is not None and (isinstance(error, asyncio.CancelledError)
                            or write_errors.classify(error) is not None):
    return
  loop.default_exception_handler(context)


class DrainingPolicy(asyncio.DefaultEventLoopPolicy):
  """Event loops that cancel and await their pending tasks when closed."""

  def new_event_loop(self):
    loop = super().new_event_loop()
    loop.set_exception_handler(_quiet_owned)
    close = loop.close

    def drain_then_close():
      if not loop.is_closed() and not loop.is_running():
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
          task.cancel()
        if pending:
          loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
      _closed_loops.add(loop)
      close()
    loop.close = drain_then_close
    return loop


def is_late_callback(unraisable) -> bool:
  """Whether an unraisable report is a callback reaching a loop this module closed."""
  error = unraisable.exc_value
  if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
    return False
  tb = unraisable.exc_traceback
  while tb is not None:
    frame = tb.tb_frame
    if frame.f_code.co_name == "call_soon_threadsafe":
      owner = frame.f_locals.get("self")
      return owner is not None and owner in _closed_loops
    tb = tb.tb_next
  return False


def quiet_unraisable(unraisable) -> None:
  """``sys.unraisablehook``: drops :func:`is_late_callback` reports, passes on the rest."""
  if is_late_callback(unraisable):
    return
  _previous_hook["hook"](unraisable)


_previous_hook = {"hook": sys.__unraisablehook__}


def _install_quiet_unraisable() -> None:
  # Installed once, over whichever hook is current (a test runner's), and kept.
  if sys.unraisablehook is not quiet_unraisable:
    _previous_hook["hook"] = sys.unraisablehook
    sys.unraisablehook = quiet_unraisable


# Counted, not nested: a Checkpointer may close after one opened later (a
# restore's read-only one, a run's own), and the policy stays until the last.
_draining = {"count": 0, "previous": None}
_draining_lock = threading.Lock()


def start_draining() -> None:
  with _draining_lock:
    if _draining["count"] == 0:
      _draining["previous"] = asyncio.get_event_loop_policy()
      asyncio.set_event_loop_policy(DrainingPolicy())
    _draining["count"] += 1
    _install_quiet_unraisable()


def stop_draining() -> None:
  with _draining_lock:
    _draining["count"] -= 1
    if _draining["count"] == 0:
      asyncio.set_event_loop_policy(_draining["previous"])
      _draining["previous"] = None


@contextlib.contextmanager
def draining_event_loops():
  """Inside: every new event loop finishes its pending tasks (cancelled) before it closes."""
  start_draining()
  try:
    yield
  finally:
    stop_draining()
