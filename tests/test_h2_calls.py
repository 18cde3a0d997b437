"""The driver that runs each call of the fast transport without a Task (`sidecar.rls.h2.calls`):
it must behave as a Task wherever asyncio or the sidecar's code relies on one."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest

from sidecar.rls.h2.calls import Call, Calls

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="outside")


async def test_a_call_runs_to_its_first_wait_before_start_returns() -> None:
    """The call starts inside the callback that read the request: no turn of the loop first,
    and asyncio.current_task() is the call while it runs."""
    calls = Calls()
    seen: list[Any] = []
    gate = asyncio.get_running_loop().create_future()

    async def body() -> None:
        seen.append(asyncio.current_task())
        seen.append(await gate)
        seen.append(asyncio.current_task())

    call = calls.start(body())
    assert seen == [call]
    assert calls.running == {call}
    gate.set_result("answer")
    await calls.idle()
    assert seen == [call, "answer", call]
    assert call.done and not calls.running


async def test_asyncio_timeout_inside_a_call_raises_timeout_error() -> None:
    """asyncio.timeout works on a call as on a Task: the wait is cut at the deadline and the
    coroutine goes on after catching TimeoutError."""
    calls = Calls()
    outcome: list[str] = []
    never = asyncio.get_running_loop().create_future()

    async def body() -> None:
        try:
            async with asyncio.timeout(0.01):
                await never
        except TimeoutError:
            outcome.append("timed out")
        outcome.append("went on")

    calls.start(body())
    await asyncio.wait_for(calls.idle(), 2)
    assert outcome == ["timed out", "went on"]
    assert never.cancelled()


async def test_cancel_throws_cancelled_error_into_the_waiting_coroutine() -> None:
    """Cancelling a call cancels what it waits on; the coroutine sees CancelledError there."""
    calls = Calls()
    seen: list[str] = []

    async def body() -> None:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    call = calls.start(body())
    assert call.cancel() is True
    await asyncio.wait_for(calls.idle(), 2)
    assert seen == ["cancelled"]
    assert call.cancel() is False  # ended: nothing left to cancel


async def test_cancel_after_the_awaited_future_completed_still_cancels() -> None:
    """A cancel that arrives between a future's completion and the call's wake-up wins, as with
    a Task: the coroutine gets CancelledError, not the value."""
    calls = Calls()
    seen: list[str] = []
    gate = asyncio.get_running_loop().create_future()

    async def body() -> None:
        try:
            seen.append(await gate)
        except asyncio.CancelledError:
            seen.append("cancelled")

    call = calls.start(body())
    gate.set_result("value")  # the wake-up is scheduled, not run
    call.cancel()
    await asyncio.wait_for(calls.idle(), 2)
    assert seen == ["cancelled"]


async def test_a_bare_yield_gives_the_loop_one_turn() -> None:
    """asyncio.sleep(0) inside a call lets other callbacks run, then the call goes on."""
    calls = Calls()
    order: list[str] = []

    async def body() -> None:
        order.append("before")
        await asyncio.sleep(0)
        order.append("after")

    asyncio.get_running_loop().call_soon(order.append, "other")
    calls.start(body())
    await asyncio.wait_for(calls.idle(), 2)
    assert order == ["before", "other", "after"]


async def test_context_changes_stay_inside_the_call() -> None:
    """Each call runs in its own copy of the context, as a Task does."""
    calls = Calls()
    seen: list[str] = []

    async def body() -> None:
        VAR.set("inside")
        await asyncio.sleep(0)
        seen.append(VAR.get())

    calls.start(body())
    await asyncio.wait_for(calls.idle(), 2)
    assert seen == ["inside"]
    assert VAR.get() == "outside"


async def test_shield_and_gather_work_inside_a_call() -> None:
    """Code written for a Task (asyncio.shield, asyncio.gather of coroutines) runs unchanged."""
    calls = Calls()
    results: list[Any] = []

    async def double(value: int) -> int:
        await asyncio.sleep(0)
        return value * 2

    async def body() -> None:
        results.append(await asyncio.shield(double(1)))
        results.append(await asyncio.gather(double(2), double(3)))

    calls.start(body())
    await asyncio.wait_for(calls.idle(), 2)
    assert results == [2, [4, 6]]


async def test_an_exception_escaping_a_call_is_logged_and_ends_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A call whose coroutine raises ends, and the error is logged rather than lost."""
    calls = Calls()

    async def body() -> None:
        await asyncio.sleep(0)
        raise ValueError("broken handler")

    call = calls.start(body())
    await asyncio.wait_for(calls.idle(), 2)
    assert call.done and not calls.running
    assert "broken handler" in capsys.readouterr().out


async def test_awaiting_something_that_is_not_a_future_is_an_error_in_the_call() -> None:
    """A coroutine that yields an object the driver cannot wait on gets RuntimeError, as a Task
    would throw it."""
    calls = Calls()
    errors: list[str] = []

    class Odd:
        def __await__(self) -> Any:
            yield "not a future"

    async def body() -> None:
        try:
            await Odd()
        except RuntimeError as exc:
            errors.append(str(exc))

    calls.start(body())
    await asyncio.wait_for(calls.idle(), 2)
    assert errors and "not a future" in errors[0]


async def test_idle_is_done_at_once_when_no_call_runs() -> None:
    """Waiting for the calls to end does not wait when there are none."""
    assert Calls().idle().done()


def test_call_has_the_task_methods_asyncio_timeout_uses() -> None:
    """cancel, cancelling and uncancel: what asyncio.timeout calls on the current task."""
    assert all(hasattr(Call, name) for name in ("cancel", "cancelling", "uncancel", "get_loop"))
