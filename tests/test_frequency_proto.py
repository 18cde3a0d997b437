"""The committed Python stubs of the protos are exactly what grpcio-tools generates,
and the proto's names live apart from Envoy's in the protobuf registry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Every proto of proto/: the frequency caps, and the reference's RateLimitConfig (rules over xDS).
PROTOS = (
    Path("ratelimit_sidecar/frequency/v1/frequency.proto"),
    Path("ratelimit/config/ratelimit/v3/rls_conf.proto"),
)
STUBS = ROOT / "sidecar" / "proto"


@pytest.mark.parametrize("proto", PROTOS, ids=lambda path: path.stem)
def test_regenerating_the_stubs_changes_nothing(tmp_path: Path, proto: Path) -> None:
    """`make proto` (grpcio-tools, pinned in the test extra) writes the committed files byte for
    byte; after editing a proto, run it and commit the result."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("grpcio-tools not installed, and CI=true forbids skipping")
        pytest.skip(
            "grpcio-tools not installed (pip install -e '.[test]'; under CI=true this fails)"
        )
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"),
            f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", str(ROOT / "proto" / proto),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    for suffix in ("_pb2.py", "_pb2.pyi"):
        name = proto.with_name(proto.stem + suffix)
        assert (tmp_path / name).read_bytes() == (STUBS / name).read_bytes(), name


def test_the_frequency_messages_sit_beside_envoys_in_one_registry() -> None:
    """Both protos load into the default pool; the frequency service has its own package."""
    from envoy.service.ratelimit.v3 import rls_pb2

    from sidecar.frequency.service import SERVICE_NAME
    from sidecar.proto.ratelimit_sidecar.frequency.v1 import frequency_pb2

    service = frequency_pb2.DESCRIPTOR.services_by_name["FrequencyCaps"]
    assert service.full_name == SERVICE_NAME
    assert [m.name for m in service.methods] == ["CheckAds", "RecordImpressions"]
    assert rls_pb2.DESCRIPTOR.package == "envoy.service.ratelimit.v3"
    assert frequency_pb2.AdVerdict(remaining=4_294_967_295).remaining == 4_294_967_295
