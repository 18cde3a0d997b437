"""Calls run without a Task: each call's coroutine is stepped by a small driver, started at once
inside the callback that read the request.

A Task per call costs its construction, a turn of the event loop before the first step and a
context switch through the loop for every wake-up; at tens of thousands of calls a second that
is a tenth of the sidecar's CPU. `Call` does what a Task does for one coroutine, no more: it
sends the result of each awaited future back in (or throws its exception), waits on the next
one with a done callback, and lets a bare `yield` (`asyncio.sleep(0)`) give the loop one turn.

It stands in for a Task where asyncio looks for one: `asyncio.current_task()` returns the call
while it runs (through asyncio's `_enter_task` and `_leave_task`, as the loop's own eager tasks
do), and it has the `cancel`, `cancelling` and `uncancel` that `asyncio.timeout` relies on, so
code written for a Task (deadlines, `asyncio.shield`, `gather`) runs unchanged. Each step runs
in the call's own copy of the context, as a Task's does. Cancelling a call cancels the future it
waits on, which throws CancelledError into the coroutine at its next step, as with a Task.
"""

from __future__ import annotations

import asyncio
import contextvars
from asyncio.tasks import _enter_task, _leave_task
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

log = structlog.get_logger("sidecar.rls.h2")

# The bookkeeping behind asyncio.current_task(), present in asyncio.tasks on every version this
# project supports (3.11 to 3.13) though not in asyncio's documented API. Typed for a Task; any
# object with a Task's cancel API is taken.
_enter: Callable[[asyncio.AbstractEventLoop, Call], None] = _enter_task  # type: ignore[assignment]
_leave: Callable[[asyncio.AbstractEventLoop, Call], None] = _leave_task  # type: ignore[assignment]


class Calls:
    """The calls running on one event loop, and a way to wait until none is left.

    It counts every call until it answers (`opened`, `answered`: every call answers through a
    callback), and drives the coroutines of those that run one (`start`): only those can be
    cancelled; the others end by their own deadline.
    """

    def __init__(self) -> None:
        self.running: set[Call] = set()
        #: Calls answering through a callback, not answered yet.
        self.answering = 0
        self._idle: asyncio.Future[None] | None = None

    def start(self, coro: Coroutine[Any, Any, None]) -> Call:
        """Run `coro` until it first waits, now; it goes on as what it awaits completes.

        The call steps in its own copy of the context current now.
        """
        call = Call(coro, self)
        self.running.add(call)
        loop = call.get_loop()
        # Started from inside a task (not the server's case: it starts calls from the callback
        # that read the request), the call is current while it runs, then the task again.
        outer = asyncio.current_task(loop)
        if outer is not None:
            _leave_task(loop, outer)
        try:
            call.run_first()
        finally:
            if outer is not None:
                _enter_task(loop, outer)
        return call

    def finished(self, call: Call) -> None:
        self.running.discard(call)
        if self._idle is not None:
            self._check_idle()

    def opened(self) -> None:
        """A call that answers through a callback has started."""
        self.answering += 1

    def answered(self) -> None:
        """A call that answers through a callback has answered."""
        self.answering -= 1
        if self._idle is not None:
            self._check_idle()

    def _check_idle(self) -> None:
        idle = self._idle
        if idle is not None and not self.running and not self.answering:
            self._idle = None
            if not idle.done():
                idle.set_result(None)

    def idle(self) -> asyncio.Future[None]:
        """A future done once no call is running (done already when none is)."""
        if not self.running and not self.answering:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        if self._idle is None:
            self._idle = asyncio.get_running_loop().create_future()
        return self._idle

    def cancel_all(self) -> None:
        """Cancel the coroutines; calls answering through a callback end by their deadline."""
        for call in list(self.running):
            call.cancel()


class Call:
    """One coroutine, driven as a Task would drive it (see the module docstring)."""

    __slots__ = (
        "_calls",
        "_cancel_requested",
        "_cancelling",
        "_context",
        "_coro",
        "_loop",
        "_waiting",
        "done",
    )

    def __init__(self, coro: Coroutine[Any, Any, None], calls: Calls) -> None:
        self._coro = coro
        self._calls = calls
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()
        self._waiting: asyncio.Future[Any] | None = None
        self._cancel_requested = False  # cancel() came while nothing could take it
        self._cancelling = 0
        self.done = False

    # --- what asyncio asks of the current task -------------------------------------------------

    def cancel(self, msg: Any = None) -> bool:
        """Throw CancelledError into the coroutine at its next step; False once it has ended."""
        if self.done:
            return False
        self._cancelling += 1
        waiting = self._waiting
        if waiting is not None and waiting.cancel(msg=msg):
            return True  # its done callback throws CancelledError in
        self._cancel_requested = True
        return True

    def cancelling(self) -> int:
        return self._cancelling

    def uncancel(self) -> int:
        if self._cancelling > 0:
            self._cancelling -= 1
        return self._cancelling

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    # --- driving -------------------------------------------------------------------------------

    def run_first(self) -> None:
        """The first step, in the call's context."""
        self._context.run(self.step)

    def _finish(self) -> None:
        self.done = True
        self._calls.finished(self)

    def step(
        self, future: asyncio.Future[Any] | None = None, error: BaseException | None = None
    ) -> None:
        """Send the result of `future` (or throw its exception, or `error`) into the coroutine,
        and wait on what it awaits next. Run in the call's context: the loop runs it there as
        the done callback and the bare-yield callback it is registered as."""
        value = None
        if future is not None:
            self._waiting = None
            try:
                value = future.result()
            except BaseException as exc:  # handed to the coroutine, as a Task does
                error = exc
        if self._cancel_requested:
            self._cancel_requested = False
            error = asyncio.CancelledError()
        loop = self._loop
        _enter(loop, self)
        try:
            awaited = self._coro.send(value) if error is None else self._coro.throw(error)
        except (StopIteration, asyncio.CancelledError):
            self._finish()
            return
        except (KeyboardInterrupt, SystemExit):
            self._finish()
            raise
        except BaseException as exc:  # a Task would report it as never retrieved
            self._finish()
            log.error("call_failed", error=repr(exc), exc_info=exc)
            return
        finally:
            _leave(loop, self)
        if awaited is None:
            loop.call_soon(self.step, context=self._context)  # a bare yield: one turn
            return
        if getattr(awaited, "_asyncio_future_blocking", None):
            awaited._asyncio_future_blocking = False
            self._waiting = awaited
            awaited.add_done_callback(self.step, context=self._context)
            if self._cancel_requested and awaited.cancel():
                self._cancel_requested = False
            return
        problem = RuntimeError(f"a call awaited something that is not a future: {awaited!r}")
        loop.call_soon(self.step, None, problem, context=self._context)
