"""A small ShouldRateLimit client for `ratelimit-sidecar query`, like the reference's client_cmd."""

from __future__ import annotations

from collections.abc import Sequence

import grpc  # type: ignore[import-untyped]
from google.protobuf import json_format, text_format  # type: ignore[import-untyped]

from sidecar.model import Code
from sidecar.rls.messages import RateLimitRequest, RateLimitResponse
from sidecar.rls.server import METHOD


class QueryError(Exception):
    """The call failed: `str()` is the gRPC status name and its details."""


def parse_descriptor(text: str) -> list[tuple[str, str]]:
    """`k=v[,k2=v2]` as entries; raises ValueError for a pair without '=' or with an empty key."""
    entries = []
    for pair in text.split(","):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"descriptor {text!r}: expected key=value[,key2=value2], got {pair!r}")
        entries.append((key, value))
    return entries


def query(
    address: str,
    domain: str,
    descriptors: Sequence[Sequence[tuple[str, str]]],
    hits_addend: int = 0,
    timeout: float = 5.0,
) -> RateLimitResponse:
    """Send one request; raises QueryError when the call fails."""
    request = RateLimitRequest(domain=domain, hits_addend=hits_addend)
    for entries in descriptors:
        descriptor = request.descriptors.add()
        for key, value in entries:
            descriptor.entries.add(key=key, value=value)
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            METHOD,
            request_serializer=RateLimitRequest.SerializeToString,
            response_deserializer=RateLimitResponse.FromString,
        )
        try:
            return call(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise QueryError(f"{exc.code().name}: {exc.details()}") from exc


def overall_code(response: RateLimitResponse) -> Code:
    return Code(response.overall_code)


def render(response: RateLimitResponse, fmt: str) -> str:
    """The response as protobuf text format (`text`) or proto3 JSON (`json`)."""
    if fmt == "json":
        text: str = json_format.MessageToJson(response, indent=2)
        return text
    rendered: str = text_format.MessageToString(response)
    return rendered.rstrip("\n")
