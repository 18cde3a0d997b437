"""`ratelimit_sidecar.frequency.v1.FrequencyCaps` as a transport sees it: request bytes in,
response bytes out, over the use case in `sidecar.frequency`.

Like `service.py`, nothing here knows the transport. The proto is the project's own
(`proto/ratelimit_sidecar/frequency/v1/frequency.proto`, stubs in `sidecar.proto`); its package
keeps its names apart from Envoy's in the protobuf registry. An empty `campaign` means none,
an empty `event` an impression; `identities` may stand beside `user` or for it (empty).
A call that cannot be answered raises InvalidRequest (INVALID_ARGUMENT), UnknownDomain
(NOT_FOUND) or StorageError (UNAVAILABLE: the ad server decides what to serve without caps).
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from sidecar.errors import InvalidRequest
from sidecar.frequency.caps import IMPRESSION, FrequencyCaps, Impression
from sidecar.proto.ratelimit_sidecar.frequency.v1 import frequency_pb2 as pb

SERVICE_NAME = "ratelimit_sidecar.frequency.v1.FrequencyCaps"
CHECK_ADS = f"/{SERVICE_NAME}/CheckAds"
RECORD_IMPRESSIONS = f"/{SERVICE_NAME}/RecordImpressions"


class FrequencyService:
    """CheckAds and RecordImpressions on serialized messages."""

    def __init__(self, caps: FrequencyCaps) -> None:
        self.caps = caps

    async def check_ads(self, body: bytes) -> bytes:
        request = _parse(pb.CheckAdsRequest, body)
        # (Pairs, not Candidates: a named tuple is made by a Python call, 50 a check.)
        candidates = [(ad.ad, ad.campaign or None) for ad in request.ads]
        verdicts = await self.caps.check(
            request.domain,
            request.user,
            candidates,
            request.event or IMPRESSION,
            list(request.identities.items()),
        )
        # Each verdict added in place: building AdVerdicts to hand over costs 60% more a call.
        response = pb.CheckAdsResponse()
        add = response.ads.add
        for v in verdicts:
            add(ad=v.ad, allowed=v.allowed, remaining=v.remaining, reset_seconds=v.reset_seconds)
        return bytes(response.SerializeToString())

    async def record_impressions(self, body: bytes) -> bytes:
        request = _parse(pb.RecordImpressionsRequest, body)
        impressions = [
            Impression(
                i.id,
                i.user,
                i.ad,
                i.campaign or None,
                i.event or IMPRESSION,
                list(i.identities.items()),
            )
            for i in request.impressions
        ]
        results = await self.caps.record(request.domain, impressions)
        response = pb.RecordImpressionsResponse(
            results=[
                pb.ImpressionResult(id=r.id, counted=r.counted, duplicate=not r.counted)
                for r in results
            ]
        )
        return bytes(response.SerializeToString())


_Request = TypeVar("_Request", pb.CheckAdsRequest, pb.RecordImpressionsRequest)


def _parse(kind: type[_Request], body: bytes) -> _Request:
    try:
        message: _Request = kind.FromString(body)
    except DecodeError as exc:
        raise InvalidRequest(f"malformed {kind.__name__}: {exc}") from exc
    return message
