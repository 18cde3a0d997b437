"""The HTTP side, on the same event loop as gRPC, answering as the reference's endpoints do.

- `POST /json`: a `RateLimitRequest` in proto3 JSON; the response JSON with status 200 (OK),
  429 (OVER_LIMIT) or 500 (UNKNOWN); 400 with the reason for bad JSON or an invalid request;
  413 for a body over 1 MiB; 503 when the backend has as many calls in flight as it answers
  in time (Overloaded). An error's status is `sidecar.rls.statuses`'.
- `GET /healthcheck`: 200 `OK`, or 500 with the reason when unhealthy (`sidecar.http.health`: after
  SIGTERM, while the backend fails its ping under --failure-mode deny, or while the
  configuration makes it unusable).
- `GET /rlconfig`: the loaded rules, one line per rule (the reference's format).
- `GET /metrics`: Prometheus text format.
- `POST /v1/caps/check`, `POST /v1/caps/record`: frequency caps for ad servers, in JSON (see
  `json_api.py`): 200 with the answer, 400 with `{"error": reason}` for a bad body, 404 for
  a domain without caps, 413 for a body over 1 MiB, 503 when the backend fails.
- `GET /v1/usage`: usage per day (`sidecar.reports.usage`): 200 with the JSON, 400 with
  `{"error": reason}` for a bad query, 404 for a domain without usage, 503 when the backend
  fails. `GET /v1/usage/dimensions`: the rules and what each domain counts.
  `GET /v1/refusing`: the limits that refused calls in the last minute.
- `GET /ui`: a page drawing all of that (`sidecar/ui/index.html`, self-contained).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from importlib.resources import files
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.core import usage
from sidecar.core.rules import Rules
from sidecar.errors import StorageError
from sidecar.frequency import json_api
from sidecar.frequency.caps import FrequencyCaps
from sidecar.http.bodies import BodyRefused, read_body
from sidecar.http.health import Health
from sidecar.http.listener import Listener
from sidecar.model import Code
from sidecar.reports import usage as usage_api
from sidecar.rls.service import RateLimitService
from sidecar.rls.statuses import statuses
from sidecar.telemetry import metrics

MAX_BODY_BYTES = 1 << 20


_JSON_STATUS = {Code.OK: 200, Code.OVER_LIMIT: 429, Code.UNKNOWN: 500}
_INDEX = """ratelimit-sidecar
  POST /json          RateLimitRequest in proto3 JSON -> RateLimitResponse JSON
                      (200 OK, 429 OVER_LIMIT, 400 bad request)
  GET  /healthcheck   200 OK when healthy, else 500
  GET  /rlconfig      loaded rules, one line per rule
  GET  /metrics       Prometheus metrics
  POST /v1/caps/check   frequency caps: which of these ads may a user still see (JSON)
  POST /v1/caps/record  frequency caps: count impressions exactly once (JSON)
  GET  /v1/usage      usage per day: ?domain=D&by=KEY[,KEY][&day=YYYY-MM-DD|&from=&to=][&top=N]
  GET  /v1/usage/dimensions  the rules loaded and what each domain counts
  GET  /v1/refusing   the limits that refused calls in the last minute
  GET  /ui            a page of the rules, usage charts, top keys and limits refusing now
"""
_PAGE = (files("sidecar") / "ui" / "index.html").read_bytes()


class AdminServer:
    """An aiohttp server for one sidecar; `start` returns the bound port."""

    def __init__(
        self,
        service: RateLimitService,
        rules: Rules,
        health: Health,
        registry: CollectorRegistry,
        host: str,
        port: int,
        shutdown_timeout: float = 5.0,
        reuse_port: bool = False,
        frequency: FrequencyCaps | None = None,
        usage_reader: usage.Reader | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service = service
        #: Where usage is read (the backend); None: `/v1/usage` answers 503.
        self.usage_reader = usage_reader
        self._clock = clock
        self.refusals = usage_api.Refusals(service.stats)
        self.frequency = frequency
        self.rules = rules
        self.health = health
        self.registry = registry
        self.host = host
        self.port = port
        # Only worker processes share a port (`serve --workers N`); otherwise a second server on
        # the same port is an error, not a silent share of the traffic.
        self._listener = Listener(
            "HTTP", host, port, reuse_port=reuse_port, shutdown_timeout=shutdown_timeout
        )

    def application(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/", self._index)
        app.router.add_post("/json", self._json)
        app.router.add_get("/healthcheck", self._healthcheck)
        app.router.add_get("/rlconfig", self._rlconfig)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/usage", self._usage)
        app.router.add_get("/v1/usage/dimensions", self._usage_dimensions)
        app.router.add_get("/v1/refusing", self._refusing)
        app.router.add_get("/ui", self._ui)
        if self.frequency is not None:
            app.router.add_post("/v1/caps/check", self._caps_check)
            app.router.add_post("/v1/caps/record", self._caps_record)
        return app

    async def start(self) -> int:
        return await self._listener.start(self.application())

    async def stop(self) -> None:
        """Stop listening and let requests in flight finish (up to the shutdown timeout)."""
        await self._listener.stop()

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(text=_INDEX)

    async def _json(self, request: web.Request) -> web.Response:
        try:
            body = await read_body(request, MAX_BODY_BYTES)
        except BodyRefused as exc:
            return exc.answer(web.Response(status=exc.status, text=f"{exc.status.phrase}: {exc}\n"))
        try:
            code, text = await self.service.should_rate_limit_json(body)
        except Exception as exc:
            _, status = statuses(exc)
            if status is HTTPStatus.INTERNAL_SERVER_ERROR:
                raise  # a bug: aiohttp's 500, logged with its traceback
            return web.Response(status=status, text=f"{status.phrase}: {exc}\n")
        return web.Response(status=_JSON_STATUS[code], text=text, content_type="application/json")

    async def _healthcheck(self, request: web.Request) -> web.Response:
        if await self.health.check():
            return web.Response(text="OK")
        return web.Response(status=500, text=f"Internal Server Error: {self.health.reason}\n")

    async def _rlconfig(self, request: web.Request) -> web.Response:
        lines = self.rules.dump()
        return web.Response(text="".join(f"{line}\n" for line in lines))

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=metrics.render(self.registry))
        response.headers["Content-Type"] = metrics.CONTENT_TYPE
        return response

    # --- Usage (sidecar.core.usage) and the page -------------------------------------------------

    async def _usage(self, request: web.Request) -> web.Response:
        now_ms = int(self._clock() * 1000)
        try:
            query = usage_api.parse(self.rules, request.query, now_ms)
        except usage_api.QueryError as exc:
            return _json_error(404 if exc.missing else 400, str(exc))
        if self.usage_reader is None:
            return _json_error(503, "usage cannot be read from this backend")
        try:
            answer = await usage_api.answer(self.usage_reader, query)
        except StorageError as exc:
            return _json_error(503, f"usage unavailable: {exc}")
        return web.json_response(answer, dumps=_dumps)

    async def _usage_dimensions(self, request: web.Request) -> web.Response:
        answer = usage_api.dimensions(self.rules, int(self._clock() * 1000))
        return web.json_response(answer, dumps=_dumps)

    async def _refusing(self, request: web.Request) -> web.Response:
        return web.json_response(self.refusals.now(), dumps=_dumps)

    async def _ui(self, request: web.Request) -> web.Response:
        return web.Response(body=_PAGE, content_type="text/html", charset="utf-8")

    # --- Frequency caps (sidecar.frequency) ---------------------------------------------------

    async def _caps_check(self, request: web.Request) -> web.Response:
        caps = self.frequency
        assert caps is not None

        async def check(body: bytes) -> dict[str, Any]:
            return json_api.check_response(await caps.check(*json_api.check_request(body)))

        return await _caps_call(request, check)

    async def _caps_record(self, request: web.Request) -> web.Response:
        caps = self.frequency
        assert caps is not None

        async def record(body: bytes) -> dict[str, Any]:
            domain, impressions = json_api.record_request(body)
            return json_api.record_response(await caps.record(domain, impressions))

        return await _caps_call(request, record)


async def _caps_call(
    request: web.Request, call: Callable[[bytes], Awaitable[dict[str, Any]]]
) -> web.Response:
    """Run a frequency-cap call on the request's body; every outcome is JSON."""
    try:
        body = await read_body(request, MAX_BODY_BYTES)
    except BodyRefused as exc:
        return exc.answer(_json_error(exc.status, str(exc)))
    try:
        answer = await call(body)
    except Exception as exc:
        _, status = statuses(exc)
        if status is HTTPStatus.INTERNAL_SERVER_ERROR:
            raise  # a bug: aiohttp's 500, logged with its traceback
        unavailable = status is HTTPStatus.SERVICE_UNAVAILABLE
        return _json_error(status, f"counters unavailable: {exc}" if unavailable else str(exc))
    return web.json_response(answer, dumps=_dumps)


def _json_error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status, dumps=_dumps)


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
