"""Reading an HTTP request's body with a deadline and a size limit, for the admin port and the
webhook: a client that sends its headers and then trickles its body must not hold a handler
(and the body's buffer) for as long as it likes.

A body refused is one `BodyRefused`, whose status (408 or 413) and reason are written here
once; each edge only puts them in its own format (text, JSON, an AdmissionReview) and hands
its answer to `BodyRefused.answer`, which closes the connection when the body was not read."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from aiohttp import web

#: Seconds a client has to send a request's whole body once its headers are in; a body that
#: trickles in slower is answered 408 and the connection closed.
BODY_TIMEOUT = 10.0


#: Seconds aiohttp goes on reading (and dropping) a body left unread after its answer, before
#: it closes the connection (its default is 10).
LINGERING_SECONDS = 1.0


class BodyRefused(Exception):
    """A body not read: it did not arrive within BODY_TIMEOUT (408) or is larger than the
    application's limit (413); `str()` is the reason."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status

    def answer(self, response: web.Response) -> web.Response:
        """`response` (the edge's answer of `status` and the reason), and after a body that
        trickled in, the connection closed: the rest of the body was not read."""
        if self.status is HTTPStatus.REQUEST_TIMEOUT:
            response.force_close()
        return response


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's body within BODY_TIMEOUT and `limit` bytes (the application's
    `client_max_size`, which aiohttp enforces); raises BodyRefused for one that is not."""
    try:
        async with asyncio.timeout(BODY_TIMEOUT):
            return await request.read()
    except TimeoutError:
        raise BodyRefused(
            HTTPStatus.REQUEST_TIMEOUT, f"the body took longer than {BODY_TIMEOUT:g} s"
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise BodyRefused(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body too large: at most {limit} bytes"
        ) from None
