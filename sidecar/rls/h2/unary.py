"""Unary gRPC over HTTP/2, the parts the HTTP/2 layer does not know: status codes, the one
length-prefixed message of a request body, and how a method reports a status other than OK.

A request body is exactly one message: a compressed flag (0, since no grpc-encoding is
accepted), a 4-byte big-endian length, and that many bytes. Anything else is answered INTERNAL
with a message naming what is wrong, as grpc-go does for a framing it cannot read.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Final

PREFIX_SIZE: Final = 5
#: The largest request message accepted (grpc's default receive limit).
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024

#: A method written as a coroutine: the request message in, the response message out. It
#: reports any other status by raising CallError. The server serves it in the callback form
#: (`H2Server.driven`), the one form it answers calls in.
Method = Callable[[bytes], Awaitable[bytes]]

#: How a `CallbackMethod` answers: with the response message, or with an exception (CallError
#: for another status; anything else is a bug, answered INTERNAL).
Answer = Callable[[bytes | Exception], None]


class CallbackMethod:
    """A method that answers through a callback instead of being awaited: the form the server
    answers every call in, so that a call on the hot path costs no coroutine, task or future.

    `handle(message, answer)` calls `answer` exactly once, at once or later from the event loop
    (a second answer is ignored). An exception `handle` raises before it answers is the answer.
    `errors` turns an exception other than CallError into the CallError to answer with (without
    it, such an exception is a bug, answered INTERNAL). `observe` gets each call's duration in
    seconds, from the request's arrival to its answer.
    """

    __slots__ = ("errors", "handle", "observe")

    def __init__(
        self,
        handle: Callable[[bytes, Answer], None],
        *,
        errors: Callable[[Exception], CallError] | None = None,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        self.handle = handle
        self.errors = errors
        self.observe = observe


class Status(enum.IntEnum):
    """gRPC status codes (grpc/doc/statuscodes.md)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class CallError(Exception):
    """Raised by a method to answer with `status` and `message` instead of a response."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


def read_message(body: bytes) -> bytes:
    """The one message of a unary request body; raises CallError when the framing is wrong."""
    if len(body) < PREFIX_SIZE:
        raise CallError(
            Status.INTERNAL,
            f"grpc: request body of {len(body)} bytes has no complete message prefix",
        )
    flag = body[0]
    length = int.from_bytes(body[1:PREFIX_SIZE], "big")
    if flag != 0:
        raise CallError(
            Status.INTERNAL,
            "grpc: compressed message but no grpc-encoding was negotiated"
            if flag == 1
            else f"grpc: invalid compressed flag {flag}",
        )
    if length > MAX_MESSAGE_BYTES:
        raise CallError(
            Status.RESOURCE_EXHAUSTED,
            f"grpc: received message larger than max ({length} vs. {MAX_MESSAGE_BYTES})",
        )
    available = len(body) - PREFIX_SIZE
    if available < length:
        raise CallError(Status.INTERNAL, f"grpc: message truncated: {available} of {length} bytes")
    if available > length:
        raise CallError(Status.INTERNAL, "grpc: more than one request message in a unary call")
    return body[PREFIX_SIZE:]


def message_frame(message: bytes) -> bytes:
    """A response message with its prefix, as the DATA of a response."""
    return b"\x00" + len(message).to_bytes(4, "big") + message
