"""The RLS messages at the Envoy API version the sidecar speaks (`envoy_api.ENVOY_API`).

Classes made from `sidecar/proto/envoy_rls.binpb` (`make proto`, from proto/envoy) in a
descriptor pool of their own, beside what they import from `xds-protos` (see
`sidecar.rls.envoy_api` for why not the default pool). Every module that reads or writes RLS
messages takes them from here, so that a request's `is_negative_hits` is read wherever it
arrives; `xds-protos`' older `rls_pb2` may still be imported by anyone, and never clashes.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)

from sidecar.rls.envoy_api import imports

#: The pool holding the Envoy files of proto/envoy and what they import.
POOL = descriptor_pool.DescriptorPool()
for _serialized in imports():
    POOL.AddSerializedFile(_serialized)
for _file in descriptor_pb2.FileDescriptorSet.FromString(
    (files("sidecar.proto") / "envoy_rls.binpb").read_bytes()
).file:
    POOL.Add(_file)


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(name))


RateLimitRequest: Any = _message("envoy.service.ratelimit.v3.RateLimitRequest")
RateLimitResponse: Any = _message("envoy.service.ratelimit.v3.RateLimitResponse")
RateLimitDescriptor: Any = _message("envoy.extensions.common.ratelimit.v3.RateLimitDescriptor")
