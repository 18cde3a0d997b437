"""`RateLimitConfig` resources, as a control plane pushes them, turned into rules.

Each resource becomes the mapping a rules file's YAML would decode to, then goes through
`config.parse_mapping` and `config.gather`: the checks and error messages of rules files, with
`xds:NAME` (the resource's name) where a file name would be. proto3 cannot tell an empty string
or a false flag from an absent one, so those are left out, as the reference reads them: an empty
`value` is a key-only descriptor, an `UNKNOWN` unit is no unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import any_pb2, json_format  # type: ignore[import-untyped]

from sidecar.core import config
from sidecar.core.rules import Domain, Rules
from sidecar.errors import ConfigError
from sidecar.proto.ratelimit.config.ratelimit.v3 import rls_conf_pb2

TYPE_URL = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig"

_FLAGS = ("shadow_mode", "detailed_metric", "quota_mode")


def rules(
    resources: Sequence[any_pb2.Any], merge: bool = False, calendar_months: bool = False
) -> Rules:
    """The rules of a whole state-of-the-world response; raises ConfigError for the first
    resource that is not a RateLimitConfig, does not decode, or holds rules a file could not.
    `merge`: resources declaring one domain add up, as files do (`config.gather`);
    `calendar_months`: months are calendar months, as in files (`config.parse`)."""
    return config.gather((domain(resource, calendar_months) for resource in resources), merge)


def domain(resource: any_pb2.Any, calendar_months: bool = False) -> Domain:
    """One resource's domain; raises ConfigError naming the resource."""
    if resource.type_url != TYPE_URL:
        raise ConfigError(
            "xds", "", f"resource of type {resource.type_url!r}, expected {TYPE_URL!r}"
        )
    message = rls_conf_pb2.RateLimitConfig()
    if not resource.Unpack(message):
        raise ConfigError("xds", "", "a RateLimitConfig resource that does not decode")
    return config.parse_mapping(document(message), source(message), calendar_months)


def source(message: rls_conf_pb2.RateLimitConfig) -> str:
    """What errors and `/rlconfig` call the resource, where a rules file has its path."""
    return f"xds:{message.name or message.domain}"


def document(message: rls_conf_pb2.RateLimitConfig) -> dict[str, Any]:
    """The resource as the mapping its rules file would decode to."""
    return {"domain": message.domain, "descriptors": [_descriptor(d) for d in message.descriptors]}


def _descriptor(message: rls_conf_pb2.RateLimitDescriptor) -> dict[str, Any]:
    item: dict[str, Any] = {"key": message.key}
    if message.value:
        item["value"] = message.value
    if message.HasField("rate_limit"):
        item["rate_limit"] = _rate_limit(message.rate_limit)
    for flag in _FLAGS:
        if getattr(message, flag):
            item[flag] = True
    if message.HasField("metadata"):
        item["metadata"] = json_format.MessageToDict(message.metadata)
    if message.descriptors:
        item["descriptors"] = [_descriptor(d) for d in message.descriptors]
    return item


def _rate_limit(message: rls_conf_pb2.RateLimitPolicy) -> dict[str, Any]:
    policy: dict[str, Any] = {}
    if message.unlimited:
        policy["unlimited"] = True
    if message.unit != rls_conf_pb2.UNKNOWN or not message.unlimited:
        # UNKNOWN without `unlimited` is kept, so the error names it as the reference does.
        policy["unit"] = rls_conf_pb2.RateLimitUnit.Name(message.unit).lower()
    if not message.unlimited:
        policy["requests_per_unit"] = message.requests_per_unit
    if message.name:
        policy["name"] = message.name
    if message.replaces:
        policy["replaces"] = [{"name": r.name} for r in message.replaces]
    return policy
