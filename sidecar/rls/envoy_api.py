"""Which Envoy API the sidecar speaks, and the messages of it that PyPI's `xds-protos` lacks.

`xds-protos` (1.85.0, the newest) stops short of Envoy 1.38's `is_negative_hits` (field 4 of
`RateLimitDescriptor`). So the RLS messages come from `proto/envoy/`: the two files that carry
them, at `ENVOY_API`, compiled by `make proto` into one FileDescriptorSet
(`sidecar/proto/envoy_rls.binpb`), and loaded into a descriptor pool of their own
(`sidecar.rls.messages`). Everything they import is taken from `xds-protos`, unchanged: nothing
else is vendored.

Why a pool of their own: the default pool already holds `xds-protos`' copies of the same files
under the same names (its `rls_pb2`, which other modules import), and a pool refuses a second,
different file of one name. In a pool of their own the two never meet; on the wire they are the
same messages.

Run as `python -m sidecar.rls.envoy_api IMPORTS.binpb` (the build does) to write the
FileDescriptorSet of the imports for protoc's `--descriptor_set_in`, since `xds-protos` ships
no `.proto` files.
"""

from __future__ import annotations

import importlib
import sys

from google.protobuf import descriptor_pb2, descriptor_pool  # type: ignore[import-untyped]

#: The Envoy release whose RLS messages proto/envoy holds (README, Envoy API version).
ENVOY_API = "v1.40.0"

#: The files of proto/envoy, in the order they depend on each other.
FILES = (
    "envoy/extensions/common/ratelimit/v3/ratelimit.proto",
    "envoy/service/ratelimit/v3/rls.proto",
)

#: The `xds-protos` (and protobuf) modules that define what those files import.
IMPORTED_FROM = (
    "envoy.config.core.v3.base_pb2",
    "envoy.type.v3.ratelimit_unit_pb2",
    "envoy.type.v3.token_bucket_pb2",
    "google.protobuf.duration_pb2",
    "google.protobuf.struct_pb2",
    "google.protobuf.timestamp_pb2",
    "google.protobuf.wrappers_pb2",
    "udpa.annotations.status_pb2",
    "udpa.annotations.versioning_pb2",
    "validate.validate_pb2",
)


def imports() -> list[bytes]:
    """The serialized files the Envoy files import, with theirs, each after what it imports."""
    default = descriptor_pool.Default()
    ordered: list[bytes] = []
    done: set[str] = set()

    def add(name: str) -> None:
        if name in done:
            return
        done.add(name)
        found = default.FindFileByName(name)
        for dependency in found.dependencies:
            add(dependency.name)
        ordered.append(found.serialized_pb)

    for module in IMPORTED_FROM:
        add(importlib.import_module(module).DESCRIPTOR.name)
    return ordered


def main(argv: list[str]) -> int:
    """Write the imports' FileDescriptorSet to the file argv[1] names."""
    descriptors = descriptor_pb2.FileDescriptorSet()
    for serialized in imports():
        descriptors.file.add().ParseFromString(serialized)
    with open(argv[1], "wb") as out:
        out.write(descriptors.SerializeToString(deterministic=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
