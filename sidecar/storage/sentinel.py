"""Redis behind Sentinel: the counters live on the master the Sentinels name, followed across
failovers.

A ``redis+sentinel://`` backend is the standalone Redis backend (`redis.py`, the pipelined
client of `redis_client.py`) whose client asks `Sentinels` for its server's address before each
connection it opens. `Sentinels.locate` asks the Sentinels in turn (SENTINEL
get-master-addr-by-name) and checks that the node named says ROLE master before handing it out,
so a Sentinel that has not yet heard of a failover (it still names the old master, dead or
demoted) is passed over for the next one. Three things move the client to a new master:

- every Sentinel is subscribed to (``+switch-master``): when one announces the switch, the
  client drops its connections and the next call connects to the new master, checked as above
  (after a graceful failover the old master goes on taking writes for about ten seconds, until
  the Sentinels make it a replica: only the announcement gets the client off it in time);
- a lost connection (the master died): every new connection asks the Sentinels again, at most
  once per `redis_client.RECONNECT_BACKOFF` after a failed attempt;
- an error reply saying the node is not a usable master (READONLY, MASTERDOWN, LOADING): the
  client drops its connections, at most once per `redis_client.RECONNECT_BACKOFF`, and asks again.

The call that meets a dead, demoted or loading master fails (StorageError) and the service
answers it by its failure mode; it is not sent again to the new master. A READONLY reply means
the script's first write was refused there, so nothing was counted and a retry would be safe;
but finding the new master takes a Sentinel round trip, a ROLE check and a new connection, which
do not fit in the call's deadline (50 ms by default), and a failover already fails the calls
that were on the lost connection. The calls after it go to the new master.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import structlog

from sidecar.storage import urls
from sidecar.storage.redis import RedisBackend
from sidecar.storage.redis_client import NOT_MASTER, ConnectionLost, PipelinedRedis, RedisReplyError

#: The least time a Sentinel's answer, a ROLE check or a subscription is given (the backend's
#: timeout when longer). Finding the master is not any call's round trip (calls fail fast
#: meanwhile, by their own deadlines), and on a busy machine a 50 ms bound would turn a
#: Sentinel that is slow for a moment into a missed master and another 100 ms of backoff.
MIN_TIMEOUT = 0.2

#: A subscription to a Sentinel that failed or was lost is tried again after this long.
RESUBSCRIBE_DELAY = 1.0

log = structlog.get_logger("sidecar.storage.sentinel")

_SUBSCRIBE: tuple[Any, ...] = ("SUBSCRIBE", "+switch-master")

Address = tuple[str, int]


def from_url(url: str, timeout_ms: int = 50) -> RedisBackend:
    """A backend for ``redis+sentinel://[user:password@]host[:port][,host[:port]...]/master-name[/db]``
    or ``rediss+sentinel://`` (TLS to the Sentinels and to the master).

    The hosts are Sentinels (port 26379 when none is given), the path names the master as the
    Sentinels know it, then the database. The userinfo authenticates to the master; the query
    parameters ``sentinel_username`` and ``sentinel_password`` to the Sentinels (no
    ``sentinel_password``, no AUTH to them). With TLS, the query takes the TLS parameters of
    ``rediss://`` too (see `sidecar.storage.urls`), for both. Nothing connects yet.
    """
    location = urls.parse(url)
    if not isinstance(location, urls.SentinelURL):
        raise ValueError(
            f"{urls.redact(url)!r}: scheme must be redis+sentinel:// or rediss+sentinel://"
        )
    timeout = urls.timeout_seconds(url, timeout_ms)
    context = location.tls.context if location.tls else None
    master: dict[str, Any] = {
        "username": location.username,
        "password": location.password,
        "ssl_context": context,
        "connect_timeout": timeout,
    }
    located = Sentinels(
        location.sentinels,
        location.master_name,
        username=location.sentinel_username,
        password=location.sentinel_password,
        ssl_context=context,
        timeout=timeout,
        master=master,
    )
    client = PipelinedRedis(
        location.master_name,  # until the first connection asks the Sentinels where the master is
        urls.REDIS_PORT,
        db=location.db,
        locator=located,
        # A master that is loading may be one the Sentinels have since moved away from.
        reconnect_on=(*NOT_MASTER, "LOADING"),
        **master,
    )
    located.follow(client)
    return RedisBackend(client, timeout_ms, name="redis-sentinel")


class Sentinels:
    """The Sentinels of one master: where it is now (`locate`), and the announcements of its
    failovers, which make the followed client drop its connections (`follow`).

    Bounds: one connection to each Sentinel for questions and one for its announcements, each
    opened again at most once per RESUBSCRIBE_DELAY (questions: redis_client.RECONNECT_BACKOFF);
    one question at a time, shared by every connection being opened meanwhile; each question
    and each ROLE check given the backend's timeout, at least MIN_TIMEOUT.
    """

    def __init__(
        self,
        addresses: Sequence[Address],
        master_name: str,
        *,
        username: str | None,
        password: str | None,
        ssl_context: Callable[[], ssl.SSLContext] | None,
        timeout: float,
        master: dict[str, Any],
    ) -> None:
        self.master_name = master_name
        self._order = list(dict.fromkeys(addresses))  # the last one that answered first
        self._username = username
        self._password = password
        self._ssl = ssl_context
        self._timeout = max(timeout, MIN_TIMEOUT)
        self._master = {
            **master,
            "connect_timeout": self._timeout,
        }  # how to connect to the master (for the ROLE check)
        self._asking: dict[Address, PipelinedRedis] = {}
        self._locating: asyncio.Task[Address] | None = None
        self._watching: list[asyncio.Task[None]] = []
        self._client: PipelinedRedis | None = None
        #: The master a Sentinel announced, tried first by the next `locate`.
        self._announced: Address | None = None
        #: The address `locate` handed out last.
        self.current: Address | None = None
        # Counts the announcements: a question asked before the last one is asked again.
        self._switches = 0
        self._last_error = ""

    def follow(self, client: PipelinedRedis) -> None:
        """Drop `client`'s connections whenever a Sentinel announces that the master moved."""
        self._client = client

    async def locate(self) -> Address:
        """The master's address, as a Sentinel names it and the node itself confirms (ROLE);
        raises ConnectionLost when no Sentinel names a node that says it is the master."""
        if not self._watching:
            self._watch()
        while True:
            switches = self._switches
            task = self._locating
            if task is None:
                task = self._locating = asyncio.get_running_loop().create_task(self._ask_all())
                task.add_done_callback(self._located)
            # Shielded: a caller that gives up leaves the question to the next ones.
            address = await asyncio.shield(task)
            if switches == self._switches:  # no announcement came meanwhile
                return address

    def _located(self, task: asyncio.Task[Address]) -> None:
        self._locating = None
        if not task.cancelled():
            task.exception()  # retrieved: a failure nobody waited for is not logged as lost

    async def _ask_all(self) -> Address:
        """Try the announced master, then each Sentinel's answer, until one is a master."""
        refused: list[str] = []
        tried: set[Address] = set()
        candidates: list[tuple[Address | None, Address | None]] = []
        announced, self._announced = self._announced, None
        if announced is not None:
            candidates.append((None, announced))
        candidates += [(sentinel, None) for sentinel in self._order]
        for sentinel, address in candidates:
            if sentinel is not None:
                try:
                    address = await self._ask(sentinel)
                except Exception as exc:  # a Sentinel down or confused: ask the next
                    refused.append(f"Sentinel {_show(sentinel)}: {_reason(exc)}")
                    continue
            assert address is not None
            if address in tried:
                continue
            tried.add(address)
            role = await self._role(address)
            if role != "master":
                refused.append(f"{_show(address)} is {role}")
                continue
            if sentinel is not None and self._order[0] != sentinel:
                self._order.remove(sentinel)
                self._order.insert(0, sentinel)
            if address != self.current:
                log.info("sentinel_master", master_name=self.master_name, address=_show(address))
            self.current = address
            self._last_error = ""
            return address
        error = f"no master {self.master_name!r} found: {'; '.join(refused)}"
        if error != self._last_error:  # logged once while it lasts
            log.warning("sentinel_no_master", error=error)
            self._last_error = error
        raise ConnectionLost(error)

    async def _ask(self, sentinel: Address) -> Address:
        client = self._asking.get(sentinel)
        if client is None:
            client = self._asking[sentinel] = PipelinedRedis(
                *sentinel,
                connections=1,
                username=self._username,
                password=self._password,
                ssl_context=self._ssl,
                connect_timeout=self._timeout,
            )
        async with asyncio.timeout(self._timeout):
            reply = await client.execute("SENTINEL", "get-master-addr-by-name", self.master_name)
        if not reply:
            raise LookupError(f"does not know a master named {self.master_name!r}")
        return reply[0].decode(), int(reply[1])

    async def _role(self, address: Address) -> str:
        """What the node at `address` says it is (ROLE): "master", "slave", or why it did not
        answer. A connection of its own, closed at once: this runs once per failover."""
        probe = PipelinedRedis(*address, connections=1, **self._master)
        try:
            async with asyncio.timeout(self._timeout):
                reply = await probe.execute("ROLE")
            return str(reply[0].decode())
        except Exception as exc:  # the reason is what the caller wants
            return f"not answering ROLE ({_reason(exc)})"
        finally:
            await probe.close()

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        self._watching = [loop.create_task(self._subscribe(s)) for s in self._order]

    async def _subscribe(self, sentinel: Address) -> None:
        """Listen to `sentinel`'s ``+switch-master`` announcements, subscribing again after
        RESUBSCRIBE_DELAY whenever the connection fails; after a gap, ask where the master is,
        in case an announcement was missed."""
        subscribed_before = False
        while True:
            writer: asyncio.StreamWriter | None = None
            try:
                async with asyncio.timeout(self._timeout):
                    reader, writer = await asyncio.open_connection(
                        *sentinel,
                        ssl=self._ssl() if self._ssl else None,
                        server_hostname=sentinel[0] if self._ssl else None,
                    )
                    messages = _Messages(reader)
                    if self._password is not None:
                        credentials = (
                            (self._username, self._password)
                            if self._username
                            else (self._password,)
                        )
                        writer.write(hiredis.pack_command(("AUTH", *credentials)))
                        if isinstance(reply := await messages.next(), RedisReplyError):
                            raise reply
                    writer.write(hiredis.pack_command(_SUBSCRIBE))
                    if isinstance(reply := await messages.next(), RedisReplyError):
                        raise reply  # NOAUTH, say: nothing would ever come
                if subscribed_before:
                    self._check_soon()
                subscribed_before = True
                while True:
                    message = await messages.next()
                    if isinstance(message, list) and len(message) == 3 and message[0] == b"message":
                        self._announcement(sentinel, message[2].decode(errors="replace"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # lost or refused: subscribe again after a pause
                log.debug(
                    "sentinel_subscription_lost", sentinel=_show(sentinel), error=_reason(exc)
                )
            finally:
                if writer is not None:
                    writer.close()
            await asyncio.sleep(RESUBSCRIBE_DELAY)

    def _announcement(self, sentinel: Address, text: str) -> None:
        """``+switch-master``'s text: the master's name, its old address and its new one."""
        fields = text.split()
        if len(fields) != 5 or fields[0] != self.master_name or not fields[4].isdigit():
            return
        address = (fields[3], int(fields[4]))
        if address == self.current and self._announced is None:
            return  # another Sentinel's announcement of the same switch
        log.info(
            "sentinel_switch_master",
            master_name=self.master_name,
            address=_show(address),
            sentinel=_show(sentinel),
        )
        self._announced = address
        self._switches += 1
        self.current = None
        if self._client is not None:
            self._client.reconnect(
                f"Sentinel {_show(sentinel)} announced the master at {_show(address)}"
            )

    def _check_soon(self) -> None:
        """After a gap in the announcements: move the client if the master is elsewhere now."""

        async def check() -> None:
            known = self.current
            with contextlib.suppress(ConnectionLost):
                address = await self.locate()
                if known is not None and address != known and self._client is not None:
                    self._client.reconnect(f"the master of {self.master_name!r} moved")

        task = asyncio.get_running_loop().create_task(check())
        self._watching.append(task)
        task.add_done_callback(self._watching_ended)

    def _watching_ended(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._watching.remove(task)

    async def close(self) -> None:
        tasks = [*self._watching, *([self._locating] if self._locating else [])]
        self._watching, self._locating = [], None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        asking, self._asking = self._asking, {}
        for client in asking.values():
            await client.close()


class _Messages:
    """The replies and messages of a subscribed connection, one at a time."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._parser = hiredis.Reader(replyError=RedisReplyError)

    async def next(self) -> Any:
        while (reply := self._parser.gets()) is False:
            data = await self._reader.read(65536)
            if not data:
                raise ConnectionLost("the Sentinel closed the connection")
            self._parser.feed(data)
        return reply


def _show(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "no answer in time"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
