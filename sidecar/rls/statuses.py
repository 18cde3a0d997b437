"""Where an error becomes a status: the one table from the sidecar's errors to the gRPC status
and the HTTP status a call is answered with, for both gRPC transports (`sidecar.rls.fast`,
`sidecar.rls.server`), the quota service's streams (`sidecar.quota.service`) and the HTTP
endpoints (`sidecar.http.admin`).

    error            gRPC                HTTP
    InvalidRequest   INVALID_ARGUMENT    400   the caller must fix its request
    NegativeHitsRefused UNIMPLEMENTED  501   a refund, which this sidecar is not set to take
    UnknownDomain    NOT_FOUND           404   a frequency-cap or operator call names no known domain
    StorageError     UNAVAILABLE         503   the backend failed (frequency caps only, see below)
    Overloaded       UNAVAILABLE         503   the backend answers, but not this call in time
    OverBound        RESOURCE_EXHAUSTED  413   more than a stated bound (buckets on a quota stream);
                                               413, not 429: 429 is OVER_LIMIT's answer on /json
    anything else    INTERNAL            500   a bug: logged once per type, with its traceback

`ShouldRateLimit` never answers a StorageError: the limiter answers it by the failure mode. An
ad server, unlike Envoy, has no failure mode of its own, so a frequency-cap call is told the
counters are unavailable and decides what to serve without them. Overloaded is UNAVAILABLE,
never the failure mode: the backend is healthy, and failing open would let a flood push
admissions past any limit; UNAVAILABLE lets Envoy's `failure_mode_deny` decide, as limitador
answers a storage error.

How a refusal is counted in the statistics is `Stats.refused`'s, not this module's.
"""

from __future__ import annotations

from http import HTTPStatus

import structlog

from sidecar.errors import (
    InvalidRequest,
    NegativeHitsRefused,
    OverBound,
    Overloaded,
    StorageError,
    UnknownDomain,
)
from sidecar.rls.h2.unary import Status

#: Each error the sidecar answers on purpose: its gRPC status and its HTTP status.
STATUSES: dict[type[Exception], tuple[Status, HTTPStatus]] = {
    InvalidRequest: (Status.INVALID_ARGUMENT, HTTPStatus.BAD_REQUEST),
    NegativeHitsRefused: (Status.UNIMPLEMENTED, HTTPStatus.NOT_IMPLEMENTED),
    UnknownDomain: (Status.NOT_FOUND, HTTPStatus.NOT_FOUND),
    StorageError: (Status.UNAVAILABLE, HTTPStatus.SERVICE_UNAVAILABLE),
    Overloaded: (Status.UNAVAILABLE, HTTPStatus.SERVICE_UNAVAILABLE),
    OverBound: (Status.RESOURCE_EXHAUSTED, HTTPStatus.REQUEST_ENTITY_TOO_LARGE),
}
#: Any other exception: a bug.
BUG = (Status.INTERNAL, HTTPStatus.INTERNAL_SERVER_ERROR)

log = structlog.get_logger("sidecar.rls")


def statuses(exc: Exception) -> tuple[Status, HTTPStatus]:
    """The gRPC and HTTP statuses `exc` is answered with (of its class or its nearest base in
    STATUSES; BUG for anything else)."""
    for kind in type(exc).__mro__:
        found = STATUSES.get(kind)
        if found is not None:
            return found
    return BUG


def is_bug(exc: Exception) -> bool:
    """Whether `exc` is none of the errors the sidecar answers on purpose."""
    return statuses(exc) is BUG


class Answers:
    """The gRPC status and message each exception of a server's calls is answered with; the
    first bug of each type is logged with its traceback (later ones would only repeat it)."""

    def __init__(self) -> None:
        self._logged: set[type[BaseException]] = set()

    def grpc(self, method: str, exc: Exception) -> tuple[Status, str]:
        """The status and message for what `method` raised."""
        status, _ = statuses(exc)
        if status is not Status.INTERNAL:
            return status, str(exc)
        kind = type(exc)
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("unexpected_error", method=method, error=repr(exc), exc_info=exc)
        return status, f"internal error: {kind.__name__}: {exc}"
