"""The operator port: a listener of its own (never the gRPC or the public HTTP port) where an
operator reads and resets one descriptor's counters (`sidecar.operator.counter_admin`).

- `GET /v1/counters?domain=D&entry=KEY=VALUE[&entry=...]`: the rule that applies and what
  each of its windows holds; what a check would be answered now, and until when.
- `POST /v1/counters/reset` with `{"domain": D, "entries": [{"key": K, "value": V}, ...]}`:
  deletes the descriptor's counters (its penalty's block and strikes too) and answers their
  state after.
- `POST /v1/penalties/reset` with the same body: lifts the descriptor's penalty alone
  (`sidecar.algorithms.penalty`), its counters left; logged as `penalty_reset`.

Who may ask: the listener refuses to open on an address other than loopback unless it asks
for a bearer token (`Authorization: Bearer T`, compared in constant time; 401 without it) or
a client certificate (mTLS, checked in the TLS handshake). A bad query or body is a 400 with
`{"error": reason}`, a domain the rules lack a 404, a failing backend a 503.

Every reset is logged once (`counters_reset`: who, from where, how authenticated, what, how
many counters) and counted in `/metrics` (`ratelimit_sidecar_counter_resets{domain}`), as is
every request refused for its credentials (`ratelimit_sidecar_operator_unauthorized`).

One module past the usual size because the port is one listener whose endpoints share its
authentication (a token or mTLS), its bounds on bodies and its log of every reset.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from multidict import MultiMapping
from prometheus_client import Metric
from prometheus_client.registry import Collector

from sidecar.core.rules import Rules
from sidecar.errors import InvalidRequest
from sidecar.http.bodies import BodyRefused, read_body
from sidecar.http.listener import Listener
from sidecar.model import Entry
from sidecar.operator import counter_admin
from sidecar.rls.statuses import statuses
from sidecar.rls.tls import ServerTls, TlsError, TlsFiles
from sidecar.storage import Backend

log = structlog.get_logger("sidecar.operator")

#: The variable holding the bearer token, for a deployment that passes it in the environment
#: rather than in a file (`--operator-token-file`): never a flag, which `ps` would show.
TOKEN_VARIABLE = "RLS_OPERATOR_TOKEN"
#: A reset's body, or a GET's request line, at most: a descriptor of MAX_ENTRIES entries of
#: the longest values fits.
MAX_BODY_BYTES = 1 << 20
#: Characters of the self-declared operator name (`X-Operator`) kept in the log.
MAX_OPERATOR_NAME = 128

_INDEX = """ratelimit-sidecar operator port
  GET  /v1/counters?domain=D&entry=KEY=VALUE[&entry=KEY=VALUE ...]
                       the rule for that descriptor, its windows' counts, limits, remaining and
                       resets, and what a check would be answered now
  POST /v1/counters/reset   {"domain": D, "entries": [{"key": K, "value": V}, ...]}
                       delete that descriptor's counters (and lift its penalty); answers their
                       state after
  POST /v1/penalties/reset  {"domain": D, "entries": [{"key": K, "value": V}, ...]}
                       lift that descriptor's penalty (its block and strikes) alone
"""


class OperatorError(ValueError):
    """Operator settings that cannot serve safely or at all; the message says which and why."""


@dataclass(frozen=True)
class OperatorSettings:
    """Where the operator port listens and whom it admits (`serve --operator-*`)."""

    host: str
    port: int
    #: A file holding the bearer token (a Kubernetes Secret's volume); read at start.
    token_file: Path | None = None
    #: The token itself, from TOKEN_VARIABLE (hidden from repr: Options may be printed).
    token: str | None = field(default=None, repr=False)
    #: HTTPS on the port, and with `client_ca` a client certificate required (mTLS).
    tls: TlsFiles | None = None

    def secret(self) -> bytes | None:
        """The bearer token to require, or None; raises OperatorError for an unreadable or
        empty file, or for a port beyond loopback that admits anyone."""
        token = self.token
        if self.token_file is not None:
            try:
                token = self.token_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise OperatorError(f"--operator-token-file {self.token_file}: {exc}") from exc
        if token is not None:
            token = token.strip()
            if not token:
                raise OperatorError(
                    "the operator token is empty: write one (e.g. 32 random bytes in hex) to "
                    f"--operator-token-file or {TOKEN_VARIABLE}"
                )
        mutual = self.tls is not None and self.tls.client_ca is not None
        if token is None and not mutual and not _loopback(self.host):
            raise OperatorError(
                f"--operator-address {self.host}:{self.port} is reachable beyond this machine "
                "and would admit anyone: listen on loopback (127.0.0.1), or require a token "
                f"(--operator-token-file or {TOKEN_VARIABLE}) or client certificates "
                "(--operator-tls-client-ca)"
            )
        return None if token is None else token.encode()


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


@dataclass
class OperatorStats:
    """What `/metrics` reports of the operator port, since start."""

    #: Resets done, per domain (bounded by the rules' domains).
    resets: dict[str, int] = field(default_factory=dict)
    #: Requests refused for a missing or wrong token.
    unauthorized: int = 0


class OperatorCollector(Collector):
    """`ratelimit_sidecar_counter_resets{domain}` and `ratelimit_sidecar_operator_unauthorized`."""

    def __init__(self, stats: OperatorStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        resets = Metric(
            "ratelimit_sidecar_counter_resets",
            "Descriptors whose counters an operator reset (POST /v1/counters/reset).",
            "counter",
        )
        for domain, count in sorted(self.stats.resets.items()):
            resets.add_sample(resets.name, {"domain": domain}, float(count))
        yield resets
        refused = Metric(
            "ratelimit_sidecar_operator_unauthorized",
            "Requests to the operator port refused for a missing or wrong bearer token.",
            "counter",
        )
        refused.add_sample(refused.name, {}, float(self.stats.unauthorized))
        yield refused


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class OperatorPort:
    """The operator's listener for one sidecar; `start` returns the bound port.

    `rules` gives the rules served now (reloads replace them); `backend` is the store the
    limiter decides on; `forget` drops counters from the over-limit cache once reset.
    """

    def __init__(
        self,
        settings: OperatorSettings,
        rules: Callable[[], Rules],
        backend: Backend,
        *,
        forget: Callable[[list[tuple[bytes, bytes]]], object] = lambda names: None,
        clock: Callable[[], float] = time.time,
        reuse_port: bool = False,
    ) -> None:
        self.settings = settings
        self._token = settings.secret()
        self._tls: ServerTls | None = None
        if settings.tls is not None:
            try:
                self._tls = ServerTls(settings.tls, alpn=("http/1.1",))
            except TlsError as exc:
                raise OperatorError(f"operator TLS: {exc}") from exc
        mutual = settings.tls is not None and settings.tls.client_ca is not None
        #: What admits a request, for the log of each reset.
        self._admitted_by = " and ".join(
            [
                name
                for name, required in (("token", self._token), ("client certificate", mutual))
                if required
            ]
            or ["loopback"]
        )
        self._rules = rules
        self._backend = backend
        self._forget = forget
        self._clock = clock
        self.stats = OperatorStats()
        self._listener = Listener("operator", settings.host, settings.port, reuse_port=reuse_port)

    @property
    def tls(self) -> ServerTls | None:
        """The port's TLS, for the app to reload with the other certificates."""
        return self._tls

    def application(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES,
            middlewares=[self._admit],
            # A GET names a descriptor in its query: as long a line as a reset's body may be
            # (aiohttp's default, 8 KiB, is shorter than one value may be).
            handler_args={"max_line_size": MAX_BODY_BYTES},
        )
        app.router.add_get("/", self._index)
        app.router.add_get("/v1/counters", self._state)
        app.router.add_post("/v1/counters/reset", self._reset)
        app.router.add_post("/v1/penalties/reset", self._reset_penalty)
        return app

    async def start(self) -> int:
        context = None if self._tls is None else self._tls.listening
        return await self._listener.start(self.application(), context)

    async def stop(self) -> None:
        await self._listener.stop()

    @web.middleware
    async def _admit(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every route wants the token, when one is set (a client certificate, when required,
        was checked by the handshake)."""
        if self._token is not None:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # compare_digest takes as long whatever the first difference, so the time taken
            # tells nothing of the token.
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), self._token
            ):
                self.stats.unauthorized += 1
                response = _error(HTTPStatus.UNAUTHORIZED, "a valid bearer token is required")
                response.headers["WWW-Authenticate"] = 'Bearer realm="ratelimit-sidecar"'
                return response
        return await handler(request)

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(text=_INDEX)

    async def _state(self, request: web.Request) -> web.Response:
        try:
            domain, entries = _query(request.query)
        except InvalidRequest as exc:
            return _error(HTTPStatus.BAD_REQUEST, str(exc))
        return await self._answer(lambda: self._read(domain, entries))

    async def _read(self, domain: str, entries: tuple[Entry, ...]) -> dict[str, Any]:
        located = counter_admin.locate(self._rules(), domain, entries, self._now_ms())
        return await counter_admin.state(self._backend, located)

    async def _reset(self, request: web.Request) -> web.Response:
        named = await _named(request)
        if isinstance(named, web.Response):
            return named
        domain, entries = named

        async def reset() -> dict[str, Any]:
            located = counter_admin.locate(self._rules(), domain, entries, self._now_ms())
            if located.found is None or located.found.limit.unlimited:
                raise _NoRule(domain, entries)
            deleted = await counter_admin.reset(self._backend, located)
            names = [w if isinstance(w, tuple) else (w, b"") for w in located.addresses]
            self._forget(names)
            self.stats.resets[domain] = self.stats.resets.get(domain, 0) + 1
            log.info(
                "counters_reset",
                **_who(request, self._admitted_by),
                domain=domain,
                entries=[f"{e.key}={e.value}" for e in entries],
                rule=located.found.limit.rule_key,
                counters_deleted=deleted,
            )
            after = counter_admin.locate(self._rules(), domain, entries, self._now_ms())
            return {"counters_deleted": deleted, **await counter_admin.state(self._backend, after)}

        return await self._answer(reset)

    async def _reset_penalty(self, request: web.Request) -> web.Response:
        """Lift a descriptor's penalty, its counters left as they are; logged and counted as a
        reset of its domain."""
        named = await _named(request)
        if isinstance(named, web.Response):
            return named
        domain, entries = named

        async def reset() -> dict[str, Any]:
            located = counter_admin.locate(self._rules(), domain, entries, self._now_ms())
            if located.found is None or located.found.limit.penalty is None:
                raise _NoRule(domain, entries, "penalty")
            lifted = await counter_admin.reset_penalty(self._backend, located)
            self.stats.resets[domain] = self.stats.resets.get(domain, 0) + 1
            log.info(
                "penalty_reset",
                **_who(request, self._admitted_by),
                domain=domain,
                entries=[f"{e.key}={e.value}" for e in entries],
                rule=located.found.limit.rule_key,
                penalties_deleted=lifted,
            )
            after = counter_admin.locate(self._rules(), domain, entries, self._now_ms())
            return {"penalties_deleted": lifted, **await counter_admin.state(self._backend, after)}

        return await self._answer(reset)

    async def _answer(self, work: Callable[[], Awaitable[dict[str, Any]]]) -> web.Response:
        """`work`'s answer as JSON; its error as the status the one table gives it."""
        try:
            answer = await work()
        except _NoRule as exc:
            return _error(HTTPStatus.NOT_FOUND, str(exc))
        except Exception as exc:
            _, status = statuses(exc)
            if status is HTTPStatus.INTERNAL_SERVER_ERROR:
                raise  # a bug: aiohttp's 500, logged with its traceback
            unavailable = status is HTTPStatus.SERVICE_UNAVAILABLE
            return _error(status, f"counters unavailable: {exc}" if unavailable else str(exc))
        return web.json_response(answer, dumps=_dumps)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)


class _NoRule(Exception):
    """A reset names a descriptor no rule limits (none applies, or an unlimited one): there is
    nothing of it to reset."""

    def __init__(self, domain: str, entries: tuple[Entry, ...], what: str = "") -> None:
        shown = ",".join(f"{e.key}={e.value}" for e in entries)
        if what:
            super().__init__(f"no rule of domain {domain!r} has a {what} for {shown}")
        else:
            super().__init__(f"no rule of domain {domain!r} limits {shown or 'no entries'}")


def _query(query: MultiMapping[str]) -> tuple[str, tuple[Entry, ...]]:
    """The descriptor a GET names: `domain` once, `entry=KEY=VALUE` once per entry, in order
    (the first '=' ends the key, so a value may hold any character)."""
    unknown = sorted(set(query) - {"domain", "entry"})
    if unknown:
        raise InvalidRequest(f"unknown parameter {unknown[0]!r} (expected domain and entry)")
    domains = query.getall("domain", [])
    if len(domains) != 1 or not domains[0]:
        raise InvalidRequest("expected one domain: ?domain=D&entry=KEY=VALUE")
    entries = []
    for text in query.getall("entry", []):
        key, equals, value = text.partition("=")
        if not equals or not key:
            raise InvalidRequest(f"entry {text!r}: expected KEY=VALUE")
        entries.append(Entry(key, value))
    if not entries:
        raise InvalidRequest("expected at least one entry=KEY=VALUE")
    return domains[0], tuple(entries)


async def _named(request: web.Request) -> tuple[str, tuple[Entry, ...]] | web.Response:
    """The descriptor a reset's body names, or the answer refusing the body (too large, too
    slow, or not the JSON a reset takes)."""
    try:
        body = await read_body(request, MAX_BODY_BYTES)
    except BodyRefused as exc:
        return exc.answer(_error(exc.status, str(exc)))
    try:
        return _body(body)
    except InvalidRequest as exc:
        return _error(HTTPStatus.BAD_REQUEST, str(exc))


def _body(body: bytes) -> tuple[str, tuple[Entry, ...]]:
    """The descriptor a reset names, from its JSON body (the entries as Envoy's JSON has them)."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body is not JSON: {exc}") from exc
    if not isinstance(document, dict) or set(document) - {"domain", "entries"}:
        raise InvalidRequest('expected {"domain": D, "entries": [{"key": K, "value": V}, ...]}')
    domain, entries = document.get("domain"), document.get("entries")
    if not isinstance(domain, str) or not domain:
        raise InvalidRequest("domain: expected a non-empty string")
    if not isinstance(entries, list) or not entries:
        raise InvalidRequest("entries: expected a non-empty list of {key, value}")
    found = []
    for index, entry in enumerate(entries):
        if (
            not isinstance(entry, dict)
            or set(entry) != {"key", "value"}
            or not isinstance(entry["key"], str)
            or not isinstance(entry["value"], str)
            or not entry["key"]
        ):
            raise InvalidRequest(f'entries[{index}]: expected {{"key": K, "value": V}}')
        found.append(Entry(entry["key"], entry["value"]))
    return domain, tuple(found)


def _who(request: web.Request, admitted_by: str) -> dict[str, Any]:
    """Who asked, for the log: the peer's address, what admitted it (and the client
    certificate's subject under mTLS), and the name the client declares (`X-Operator`)."""
    peercert = request.transport.get_extra_info("peercert") if request.transport else None
    who: dict[str, Any] = {"peer": request.remote, "admitted_by": admitted_by}
    if peercert:
        subject = [f"{k}={v}" for rdn in peercert.get("subject", ()) for k, v in rdn]
        who["client_certificate"] = ",".join(subject)
    declared = request.headers.get("X-Operator", "")
    if declared:
        who["operator"] = declared[:MAX_OPERATOR_NAME]
    return who


def _error(status: HTTPStatus, reason: str, close: bool = False) -> web.Response:
    response = web.json_response({"error": reason}, status=status, dumps=_dumps)
    if close:
        response.force_close()  # its body was not read to the end
    return response


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
