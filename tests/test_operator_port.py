"""The operator port (`sidecar.operator.port`) and `ratelimit-sidecar counters` on it: an
operator finds why a client is refused and until when, and lifts it, through the real command
line against a real sidecar on Redis; and the port's guards: its own listener, the bearer
token, client certificates, loopback unless guarded, 400s with their reasons, the log and the
metrics of every reset."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from support.certs import Authority
from support.sidecars import running_app, serve_process, write_rules

from sidecar.operator.port import OperatorError, OperatorSettings
from sidecar.rls.tls import TlsFiles
from sidecar.runner.app import App, InvalidOption

RULES = """\
domain: gateway
descriptors:
  - key: remote_address
    rate_limit: {unit: day, requests_per_unit: 3, name: per-client-daily}
"""
TOKEN = "4f1d0c3e9a7b5d2f8e6c1a0b3d5f7e9c"
CLIENT = "10.0.0.1"


async def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`python -m sidecar ARGS`: its exit status, stdout and stderr."""
    import os

    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.redis
async def test_an_operator_finds_why_a_client_is_refused_and_until_when_and_lifts_it(
    redis_url: str, tmp_path: Path
) -> None:
    """A client past its daily limit is refused. The operator asks `counters` about its
    descriptor (domain and entries, as Envoy sends them; no key in sight) and reads the rule,
    OVER_LIMIT, and until when: the end of the UTC day. One `counters --reset` lifts it: the
    client's next call is admitted (the sidecar's over-limit cache forgot the counter too). The
    reset is logged once, with who and what, and counted in /metrics."""
    rules = write_rules(tmp_path, RULES)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with serve_process(
        [
            *("--config", str(rules), "--backend", redis_url),
            *("--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"),
            *("--operator-address", "127.0.0.1:0", "--operator-token-file", str(token_file)),
        ]
    ) as sidecar:
        (started,) = [e for e in sidecar.events() if e.get("event") == "started"]
        operator = f"127.0.0.1:{started['operator_port']}"
        query = (
            *("query", "--address", f"127.0.0.1:{sidecar.grpc_port}"),
            *("--domain", "gateway", "--descriptor", f"remote_address={CLIENT}"),
        )
        counters = (
            *("counters", "--address", operator, "--token-file", str(token_file)),
            *("--domain", "gateway", "--descriptor", f"remote_address={CLIENT}"),
        )
        assert (await run(*query, "--hits", "3"))[0] == 0  # the day's 3, in one call
        today = datetime.datetime.now(datetime.UTC).date()
        assert (await run(*query))[0] == 1  # OVER_LIMIT

        status, out, err = await run(*counters)
        assert status == 1, err  # 1: a check would be answered OVER_LIMIT
        midnight = datetime.datetime.combine(
            today + datetime.timedelta(days=1), datetime.time(), datetime.UTC
        )
        lines = out.splitlines()
        assert lines[0] == f"gateway: remote_address={CLIENT}"
        assert lines[1] == "  rule gateway.remote_address (per-client-daily)"
        assert lines[2].startswith(
            f"  OVER_LIMIT: 0 left of 3 per day, until {midnight.isoformat()} (in "
        )
        assert "per-client-daily per day      4      3" in lines[4]

        status, out, err = await run(*counters, "--reset")
        assert status == 0, err
        assert "  reset: 1 counters deleted" in out.splitlines()
        assert "  OK: 3 left of 3 per day" in out.splitlines()
        assert (await run(*query))[0] == 0

        async with aiohttp.ClientSession() as http:
            metrics = await (await http.get(f"http://127.0.0.1:{sidecar.http_port}/metrics")).text()
        assert 'ratelimit_sidecar_counter_resets{domain="gateway"} 1' in metrics.splitlines()
    resets = [e for e in sidecar.events() if e.get("event") == "counters_reset"]
    assert len(resets) == 1
    (reset,) = resets
    assert reset["domain"] == "gateway"
    assert reset["entries"] == [f"remote_address={CLIENT}"]
    assert reset["rule"] == "gateway.remote_address"
    assert reset["counters_deleted"] == 1
    assert reset["admitted_by"] == "token"
    assert reset["peer"] == "127.0.0.1"
    assert reset["operator"]  # the user who ran the command
    assert reset["timestamp"].startswith(today.isoformat())


# --- The port's guards, on a sidecar in this process ----------------------------------------


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[App]:
    """A sidecar (memory backend) whose operator port wants TOKEN."""
    settings = OperatorSettings("127.0.0.1", 0, token=TOKEN)
    async with running_app(write_rules(tmp_path, RULES), operator=settings) as app:
        yield app


def url(app: App, path: str, port: int | None = None) -> str:
    return f"http://127.0.0.1:{app.operator_port if port is None else port}{path}"


STATE = f"/v1/counters?domain=gateway&entry=remote_address={CLIENT}"
RESET_BODY = {"domain": "gateway", "entries": [{"key": "remote_address", "value": CLIENT}]}
BEARER = {"Authorization": f"Bearer {TOKEN}"}


async def refuse(app: App, calls: int) -> None:
    """`calls` hits of the client's descriptor through /json on the HTTP port."""
    body = {
        "domain": "gateway",
        "descriptors": [{"entries": [{"key": "remote_address", "value": CLIENT}]}],
    }
    async with aiohttp.ClientSession() as http:
        for _ in range(calls):
            await http.post(f"http://127.0.0.1:{app.http_port}/json", json=body)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}],
    ids=["no token", "wrong token", "not bearer"],
)
async def test_the_operator_port_refuses_without_the_token(
    guarded: App, headers: dict[str, str]
) -> None:
    """Without the bearer token every route answers 401 and asks for one; a reset refused so
    deletes nothing, and each refusal is counted."""
    await refuse(guarded, 4)
    async with aiohttp.ClientSession(headers=headers) as http:
        for response in (
            await http.get(url(guarded, STATE)),
            await http.post(url(guarded, "/v1/counters/reset"), json=RESET_BODY),
            await http.get(url(guarded, "/")),
        ):
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            assert await response.json() == {"error": "a valid bearer token is required"}
    async with aiohttp.ClientSession(headers=BEARER) as http:
        answer = await (await http.get(url(guarded, STATE))).json()
        metrics = await (await http.get(f"http://127.0.0.1:{guarded.http_port}/metrics")).text()
    assert answer["code"] == "OVER_LIMIT"
    assert "ratelimit_sidecar_operator_unauthorized 3" in metrics.splitlines()


async def test_the_counters_are_served_neither_on_the_grpc_nor_on_the_http_port(
    guarded: App,
) -> None:
    """The operator port is a listener of its own: the HTTP port knows no /v1/counters, and
    the gRPC port answers no HTTP/1.1 request, token or not."""
    assert guarded.operator_port not in (guarded.http_port, guarded.grpc_port)
    async with aiohttp.ClientSession(headers=BEARER) as http:
        assert (await http.get(url(guarded, STATE, guarded.http_port))).status == 404
        response = await http.post(
            url(guarded, "/v1/counters/reset", guarded.http_port), json=RESET_BODY
        )
        assert response.status in (404, 405)
        with pytest.raises(aiohttp.ClientError):
            await http.get(url(guarded, STATE, guarded.grpc_port))
        assert (await http.get(url(guarded, STATE))).status == 200


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("?entry=remote_address=1", "expected one domain: ?domain=D&entry=KEY=VALUE"),
        ("?domain=gateway", "expected at least one entry=KEY=VALUE"),
        ("?domain=gateway&entry=remote_address", "entry 'remote_address': expected KEY=VALUE"),
        ("?domain=gateway&entry==1", "entry '=1': expected KEY=VALUE"),
        (
            "?domain=gateway&domain=other&entry=a=1",
            "expected one domain: ?domain=D&entry=KEY=VALUE",
        ),
        ("?domain=gateway&entry=a=1&key=x", "unknown parameter 'key' (expected domain and entry)"),
        (f"?domain=gateway&entry=a={'v' * 8193}", "descriptors[0]: entry too long"),
    ],
)
async def test_a_bad_query_gets_400_with_its_reason(guarded: App, query: str, reason: str) -> None:
    """Every malformed GET is a 400 whose JSON says what is wrong."""
    async with aiohttp.ClientSession(headers=BEARER) as http:
        response = await http.get(url(guarded, "/v1/counters" + query))
        assert response.status == 400
        assert (await response.json())["error"].startswith(reason)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{", "body is not JSON: "),
        (b"[]", 'expected {"domain": D, "entries": [{"key": K, "value": V}, ...]}'),
        (b'{"domain": "gateway", "entries": [], "x": 1}', 'expected {"domain": D, "entries"'),
        (b'{"domain": 7, "entries": [{"key": "a", "value": "b"}]}', "domain: expected a non"),
        (b'{"domain": "gateway", "entries": []}', "entries: expected a non-empty list"),
        (b'{"domain": "gateway", "entries": [{"key": "a"}]}', "entries[0]: expected"),
        (b'{"domain": "gateway", "entries": [{"key": "a", "value": 1}]}', "entries[0]: expected"),
        (b'{"domain": "gateway", "entries": [{"key": "", "value": "b"}]}', "entries[0]: expected"),
    ],
)
async def test_a_bad_reset_gets_400_with_its_reason_and_resets_nothing(
    guarded: App, body: bytes, reason: str
) -> None:
    """Every malformed reset is a 400 whose JSON says what is wrong; no counter changes."""
    await refuse(guarded, 4)
    async with aiohttp.ClientSession(headers=BEARER) as http:
        response = await http.post(url(guarded, "/v1/counters/reset"), data=body)
        assert response.status == 400
        assert (await response.json())["error"].startswith(reason)
        assert (await (await http.get(url(guarded, STATE))).json())["code"] == "OVER_LIMIT"


async def test_an_unknown_domain_or_an_unlimited_descriptor_is_a_404(guarded: App) -> None:
    """A domain the rules lack is a 404 for both calls; a reset of a descriptor no rule
    limits is a 404 too (there is nothing to reset), while its state says no rule applies."""
    async with aiohttp.ClientSession(headers=BEARER) as http:
        response = await http.get(url(guarded, "/v1/counters?domain=nope&entry=a=1"))
        assert (response.status, await response.json()) == (
            404,
            {"error": "no domain 'nope' in the rules (domains: gateway)"},
        )
        body = {"domain": "gateway", "entries": [{"key": "path", "value": "/"}]}
        response = await http.post(url(guarded, "/v1/counters/reset"), json=body)
        assert (response.status, await response.json()) == (
            404,
            {"error": "no rule of domain 'gateway' limits path=/"},
        )
        answer = await (
            await http.get(url(guarded, "/v1/counters?domain=gateway&entry=p=1"))
        ).json()
        assert (answer["rule"], answer["code"]) == (None, "OK")


def test_a_port_beyond_loopback_needs_a_token_or_client_certificates(tmp_path: Path) -> None:
    """Unguarded, the port may listen on loopback only; a token or a client CA lets it listen
    anywhere. An empty or unreadable token file is refused with its reason."""
    assert OperatorSettings("127.0.0.1", 8082).secret() is None
    assert OperatorSettings("::1", 8082).secret() is None
    for host in ("0.0.0.0", "10.1.2.3", "operator.example"):
        with pytest.raises(OperatorError, match="would admit anyone"):
            OperatorSettings(host, 8082).secret()
    assert OperatorSettings("0.0.0.0", 8082, token=TOKEN).secret() == TOKEN.encode()
    ca = tmp_path / "ca.pem"
    mutual = TlsFiles(tmp_path / "c", tmp_path / "k", client_ca=ca)
    assert OperatorSettings("0.0.0.0", 8082, tls=mutual).secret() is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(OperatorError, match="the operator token is empty"):
        OperatorSettings("127.0.0.1", 8082, token_file=empty).secret()
    with pytest.raises(OperatorError, match=r"--operator-token-file .*missing"):
        OperatorSettings("127.0.0.1", 8082, token_file=tmp_path / "missing").secret()


async def test_an_unguarded_port_beyond_loopback_stops_the_start(tmp_path: Path) -> None:
    """The sidecar does not start with an operator port anyone could reach."""
    with pytest.raises(InvalidOption, match="would admit anyone"):
        async with running_app(
            write_rules(tmp_path, RULES), operator=OperatorSettings("0.0.0.0", 0)
        ):
            pass


async def test_with_mtls_only_a_client_certificate_of_the_ca_is_served_and_named_in_the_log(
    tmp_path: Path,
) -> None:
    """Over mTLS a client without a certificate, or with one of another CA, fails the
    handshake; one the CA signed is served, and its subject is in the reset's log."""
    authority, stranger = Authority(), Authority("stranger CA")
    cert, key = authority.issue(tmp_path, "server")
    client_cert, client_key = authority.issue(tmp_path, "oncall", client=True)
    other_cert, other_key = stranger.issue(tmp_path, "intruder", client=True)
    files = TlsFiles(cert, key, client_ca=authority.write(tmp_path / "ca.pem"))
    settings = OperatorSettings("127.0.0.1", 0, tls=files)

    def context(pair: tuple[Path, Path] | None) -> ssl.SSLContext:
        made = ssl.create_default_context(cafile=tmp_path / "ca.pem")
        if pair is not None:
            made.load_cert_chain(*pair)
        return made

    async with running_app(write_rules(tmp_path, RULES), operator=settings) as app:
        await refuse(app, 4)
        https = f"https://127.0.0.1:{app.operator_port}"
        async with aiohttp.ClientSession() as http:
            for pair in (None, (other_cert, other_key)):
                with pytest.raises(aiohttp.ClientError):
                    await (await http.get(https + STATE, ssl=context(pair))).read()
            with structlog.testing.capture_logs() as logs:
                response = await http.post(
                    https + "/v1/counters/reset",
                    json=RESET_BODY,
                    ssl=context((client_cert, client_key)),
                )
            answer: dict[str, Any] = await response.json()
    assert response.status == 200, answer
    assert (answer["counters_deleted"], answer["code"]) == (1, "OK")
    (event,) = [e for e in logs if e["event"] == "counters_reset"]
    assert event["admitted_by"] == "client certificate"
    assert event["client_certificate"] == "commonName=oncall"


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        (
            ["--operator-tls-cert", "c.pem"],
            {},
            "--operator-tls-cert needs --operator-tls-key, and the reverse",
        ),
        (
            ["--operator-tls-cert", "c", "--operator-tls-key", "k"],
            {},
            "the --operator-token-file and --operator-tls-* flags need --operator-address",
        ),
        (
            ["--operator-address", "127.0.0.1:0", "--operator-tls-client-ca", "ca"],
            {},
            "--operator-tls-client-ca needs --operator-tls-cert and --operator-tls-key",
        ),
    ],
)
def test_operator_flags_that_cannot_work_stop_serve_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    environ: dict[str, str],
    message: str,
) -> None:
    """Incomplete operator flags stop `serve` before it starts, exit status 2, one line."""
    from sidecar.cli import parse_args

    rules = str(write_rules(tmp_path, RULES))
    with pytest.raises(SystemExit) as stopped:
        parse_args(["serve", "--config", rules, *flags], environ)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"ratelimit-sidecar serve: {message}\n"


def test_the_token_comes_from_its_variable_which_is_not_an_unknown_setting(
    tmp_path: Path,
) -> None:
    """RLS_OPERATOR_TOKEN gives the operator port its token (no flag carries it, so `ps`
    never shows it), and is not reported as an unknown RLS_* variable."""
    from sidecar.cli import parse_args

    rules = str(write_rules(tmp_path, RULES))
    args = parse_args(
        ["serve", "--config", rules, "--operator-address", "127.0.0.1:8082"],
        {"RLS_OPERATOR_TOKEN": TOKEN},
    )
    assert args.operator == OperatorSettings("127.0.0.1", 8082, token=TOKEN)
    assert args.operator.secret() == TOKEN.encode()
    assert args.unknown_variables == []
    assert TOKEN not in repr(args.operator)
