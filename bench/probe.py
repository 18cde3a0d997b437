"""The one request the bench sends, and a real gRPC call that proves a server answers it with OK.

h2load cannot read gRPC trailers, so an HTTP 200 alone does not mean `overall_code: OK`.
Before and after the load the harness sends the very same bytes through a gRPC client and
decodes the answer; a server that errors or limits fails the scenario instead of giving numbers.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import text_format
from google.protobuf.message import DecodeError

from bench.processes import BenchError, Process, exited_message

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
CALL_TIMEOUT = 2.0

# A server still starting refuses connections (UNAVAILABLE) or has not answered yet.
_NOT_READY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def request(domain: str, entries: Sequence[tuple[str, str]]) -> bytes:
    """A serialized `RateLimitRequest` with one descriptor made of `entries`."""
    descriptor = ratelimit_pb2.RateLimitDescriptor(
        entries=[
            ratelimit_pb2.RateLimitDescriptor.Entry(key=key, value=value) for key, value in entries
        ]
    )
    message = rls_pb2.RateLimitRequest(domain=domain, descriptors=[descriptor])
    serialized: bytes = message.SerializeToString()
    return serialized


def grpc_frame(message: bytes) -> bytes:
    """The HTTP/2 body of a unary gRPC call: uncompressed flag, big-endian length, message."""
    return struct.pack(">BI", 0, len(message)) + message


def wait_until_ok(
    process: Process, port: int, message: bytes, timeout: float, trusted: bytes | None = None
) -> str:
    """Retry the call until the server answers, then require `overall_code: OK`; over TLS
    when given the `trusted` certificate (PEM).

    Returns the decoded response as one line of text for the report.
    """
    deadline = time.monotonic() + timeout
    last_error = "no answer"
    while time.monotonic() < deadline:
        code = process.exit_code()
        if code is not None:
            raise BenchError(exited_message(process, code))
        try:
            return check_ok(process.name, port, message, trusted)
        except grpc.RpcError as exc:
            if exc.code() not in _NOT_READY:
                raise BenchError(
                    f"{process.name} answered {exc.code().name}: {exc.details()}"
                ) from exc
            last_error = f"{exc.code().name}: {exc.details()}"
        time.sleep(0.1)
    raise BenchError(
        f"{process.name}: no gRPC answer after {timeout:g}s ({last_error})\n{process.log_tail()}"
    )


def check_ok(name: str, port: int, message: bytes, trusted: bytes | None = None) -> str:
    """One call with the raw request bytes (over TLS with `trusted`); raises grpc.RpcError or
    BenchError unless OK."""
    target = f"127.0.0.1:{port}"
    channel = (
        grpc.insecure_channel(target)
        if trusted is None
        else grpc.secure_channel(target, grpc.ssl_channel_credentials(trusted))
    )
    with channel:
        # No serializers: the exact bytes h2load sends go out, and the raw answer comes back.
        call = channel.unary_unary(METHOD)
        raw: bytes = call(message, timeout=CALL_TIMEOUT, wait_for_ready=False)
    response = rls_pb2.RateLimitResponse()
    try:
        response.ParseFromString(raw)
    except DecodeError as exc:
        raise BenchError(f"{name}: answer is not a RateLimitResponse: {raw!r}") from exc
    if response.overall_code != rls_pb2.RateLimitResponse.OK:
        code_name = rls_pb2.RateLimitResponse.Code.Name(response.overall_code)
        raise BenchError(f"{name}: overall_code is {code_name}, not OK: {_one_line(response)}")
    return _one_line(response)


def _one_line(response: rls_pb2.RateLimitResponse) -> str:
    text: str = text_format.MessageToString(response, as_one_line=True)
    return text
