"""The RLS messages of proto/envoy are Envoy 1.40.0's own, the committed FileDescriptorSet is
what `make proto` writes from them, and they live beside `xds-protos`' older copies in one
process without a clash."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2 as xds_ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2 as xds_rls_pb2
from google.protobuf import descriptor_pb2
from google.protobuf.internal.decoder import _DecodeVarint

from sidecar.rls import convert, envoy_api, messages
from sidecar.rls.messages import RateLimitDescriptor, RateLimitRequest

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "sidecar" / "proto" / "envoy_rls.binpb"


def _protoc_available() -> None:
    """grpcio-tools is among the test extras `make test` installs: missing, the test fails."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        pytest.fail("grpcio-tools not installed (make test installs it: pip install -e '.[test]')")


def test_regenerating_the_descriptor_set_changes_nothing(tmp_path: Path) -> None:
    """`make proto` (protoc of the pinned grpcio-tools, the imports handed over compiled from
    xds-protos) writes the committed FileDescriptorSet byte for byte; after editing a file of
    proto/envoy, run it and commit the result."""
    _protoc_available()
    imports = tmp_path / "imports.binpb"
    assert envoy_api.main(["envoy_api", str(imports)]) == 0
    out = tmp_path / "envoy_rls.binpb"
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"),
            f"--descriptor_set_in={imports}", f"--descriptor_set_out={out}",
            *(str(ROOT / "proto" / name) for name in envoy_api.FILES),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    assert out.read_bytes() == COMMITTED.read_bytes()


def _embedded(binary: bytes, name: str) -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto of `name` that a protobuf program (Envoy) carries serialized:
    it starts with its name (field 1), and runs for as many well-formed fields as follow."""
    start = binary.find(b"\x0a" + bytes((len(name),)) + name.encode())
    assert start >= 0, f"{name} not found in the binary"
    position = start
    while True:
        tag, after = _DecodeVarint(binary, position)
        field, wire_type = tag >> 3, tag & 7
        if not 1 <= field <= 15 or wire_type not in (0, 2):
            break
        value, after = _DecodeVarint(binary, after)
        position = after + value if wire_type == 2 else after
    return descriptor_pb2.FileDescriptorProto.FromString(binary[start:position])


def _without_json_names(file: descriptor_pb2.FileDescriptorProto) -> bytes:
    """The file's bytes without the `json_name` protoc fills in and Envoy's build strips."""
    copy = descriptor_pb2.FileDescriptorProto()
    copy.CopyFrom(file)
    pending = list(copy.message_type)
    while pending:
        message = pending.pop()
        for field in message.field:
            field.ClearField("json_name")
        pending.extend(message.nested_type)
    return copy.SerializeToString(deterministic=True)


def test_the_protos_are_envoy_1_40s_own(envoy_binary: str) -> None:
    """Every name, number, type and option of proto/envoy is what the Envoy binary the tests run
    (1.40.0) holds for the same files, `is_negative_hits` (field 4) among them."""
    version = subprocess.run(
        [envoy_binary, "--version"], check=True, capture_output=True, text=True
    ).stdout
    assert f"/{envoy_api.ENVOY_API.removeprefix('v')}/" in version
    binary = Path(os.path.realpath(envoy_binary)).read_bytes()
    ours = descriptor_pb2.FileDescriptorSet.FromString(COMMITTED.read_bytes())
    assert [file.name for file in ours.file] == list(envoy_api.FILES)
    for file in ours.file:
        assert _without_json_names(file) == _without_json_names(_embedded(binary, file.name))
    field = RateLimitDescriptor.DESCRIPTOR.fields_by_name["is_negative_hits"]
    assert (field.number, field.type) == (4, field.TYPE_BOOL)


def test_both_copies_of_the_rls_messages_live_in_one_process() -> None:
    """xds-protos' messages (the default pool) and ours (a pool of their own) are both loaded,
    with the same names; ours read field 4 where xds-protos' keep it as an unknown field, and
    the bytes each writes are read alike by the other."""
    assert xds_rls_pb2.DESCRIPTOR.name == RateLimitRequest.DESCRIPTOR.file.name
    assert messages.POOL is not xds_rls_pb2.DESCRIPTOR.pool
    assert "is_negative_hits" not in xds_ratelimit_pb2.RateLimitDescriptor.DESCRIPTOR.fields_by_name
    old = xds_rls_pb2.RateLimitRequest(domain="d")
    old.descriptors.add().entries.add(key="k", value="v")
    body = old.SerializeToString() + b"\x12\x02\x20\x01"  # a second descriptor: a refund
    new = RateLimitRequest.FromString(body)
    assert [d.is_negative_hits for d in new.descriptors] == [False, True]
    assert xds_rls_pb2.RateLimitRequest.FromString(new.SerializeToString()) == (
        xds_rls_pb2.RateLimitRequest.FromString(body)
    )
    request = convert.request(new)
    assert [d.is_negative_hits for d in request.descriptors] == [False, True]
    assert convert.request_bytes(body) == request
