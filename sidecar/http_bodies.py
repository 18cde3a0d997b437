"""Reading an HTTP request's body with a deadline, for the admin port and the webhook: a
client that sends its headers and then trickles its body must not hold a handler (and the
body's buffer) for as long as it likes."""

from __future__ import annotations

import asyncio

from aiohttp import web

#: Seconds a client has to send a request's whole body once its headers are in; a body that
#: trickles in slower is answered 408 and the connection closed.
BODY_TIMEOUT = 10.0


#: Seconds aiohttp goes on reading (and dropping) a body left unread after its answer, before
#: it closes the connection (its default is 10).
LINGERING_SECONDS = 1.0


class SlowBody(Exception):
    """The body did not arrive within BODY_TIMEOUT."""


async def read_body(request: web.Request) -> bytes:
    """The request's body within BODY_TIMEOUT; raises SlowBody past it (and, as aiohttp does,
    HTTPRequestEntityTooLarge past MAX_BODY_BYTES)."""
    try:
        async with asyncio.timeout(BODY_TIMEOUT):
            return await request.read()
    except TimeoutError:
        raise SlowBody(f"the body took longer than {BODY_TIMEOUT:g} s") from None
