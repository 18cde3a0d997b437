"""The frequency-cap calls in JSON, as the HTTP port speaks them: bodies in, answers out.

    POST /v1/caps/check   {"domain": "ads", "user": "u1",
                           "ads": [{"ad": "a1", "campaign": "c1"}, {"ad": "a2"}],
                           "event": "click",   (optional: "impression" when absent)
                           "identities": {"device": "d7", "cookie": "c9"}}   (optional)
                       -> {"ads": [{"ad": "a1", "allowed": true, "remaining": 4,
                                    "reset_seconds": 5120}, ...]}
    POST /v1/caps/record  {"domain": "ads",
                           "impressions": [{"id": "imp-1", "user": "u1", "ad": "a1",
                                            "campaign": "c1", "event": "view",
                                            "identities": {"device": "d7"}}]}
                       -> {"results": [{"id": "imp-1", "counted": true}]}
                          (a repeat: {"id": "imp-1", "counted": false, "duplicate": true})

A body that is not such an object raises InvalidRequest naming the field at fault; unknown
fields are refused too, so a misspelt "campaign" cannot silently drop a cap. `user` may be left
out when `identities` name someone. Pure: the HTTP
handlers in `admin.py` do the reading and writing.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.errors import InvalidRequest
from sidecar.frequency.caps import IMPRESSION, Candidate, Impression, Recorded, Verdict

_CHECK_KEYS = ("domain", "user", "ads", "event", "identities")
_AD_KEYS = ("ad", "campaign")
_RECORD_KEYS = ("domain", "impressions")
_IMPRESSION_KEYS = ("id", "user", "ad", "campaign", "event", "identities")


def check_request(
    body: bytes,
) -> tuple[str, str, list[Candidate], str, list[tuple[str, str]]]:
    """The arguments of `FrequencyCaps.check` from a check body, in its order: domain, user,
    candidates, event, identities."""
    document = _object(_parse(body), "body", _CHECK_KEYS)
    ads = _list(document, "ads")
    candidates = []
    for index, item in enumerate(ads):
        where = f"ads[{index}]"
        ad = _object(item, where, _AD_KEYS)
        candidates.append(
            Candidate(_string(ad, "ad", where), _optional_string(ad, "campaign", where))
        )
    event = _optional_string(document, "event", "") or IMPRESSION
    identities = _identities(document, "")
    user = _user(document, "", identities)
    return _string(document, "domain"), user, candidates, event, identities


def check_response(verdicts: Sequence[Verdict]) -> dict[str, Any]:
    return {
        "ads": [
            {
                "ad": v.ad,
                "allowed": v.allowed,
                "remaining": v.remaining,
                "reset_seconds": v.reset_seconds,
            }
            for v in verdicts
        ]
    }


def record_request(body: bytes) -> tuple[str, list[Impression]]:
    """(domain, impressions) from a record body."""
    document = _object(_parse(body), "body", _RECORD_KEYS)
    impressions = []
    for index, item in enumerate(_list(document, "impressions")):
        where = f"impressions[{index}]"
        fields = _object(item, where, _IMPRESSION_KEYS)
        identities = _identities(fields, where)
        impressions.append(
            Impression(
                _string(fields, "id", where),
                _user(fields, where, identities),
                _string(fields, "ad", where),
                _optional_string(fields, "campaign", where),
                _optional_string(fields, "event", where) or IMPRESSION,
                identities,
            )
        )
    return _string(document, "domain"), impressions


def record_response(results: Sequence[Recorded]) -> dict[str, Any]:
    return {
        "results": [
            {"id": r.id, "counted": True}
            if r.counted
            else {"id": r.id, "counted": False, "duplicate": True}
            for r in results
        ]
    }


def _identities(document: Mapping[str, Any], where: str) -> list[tuple[str, str]]:
    """The identifiers beside `user`, an object of kind to value (none when absent)."""
    name = f"{where}.identities" if where else "identities"
    raw = document.get("identities")
    if raw is None:
        return []
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{name} must be a JSON object of identifier kind to value")
    for kind, value in raw.items():
        if not isinstance(value, str):
            raise InvalidRequest(f"{name}.{kind} must be a string, got {json.dumps(value)}")
    return list(raw.items())


def _user(document: Mapping[str, Any], where: str, identities: Sequence[object]) -> str:
    """`user`, which may be left out (empty) when `identities` name someone."""
    if identities and document.get("user") is None:
        return ""
    return _string(document, "user", where)


def _parse(body: bytes) -> object:
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"body is not UTF-8 ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"body is not JSON: {exc}") from exc
    except RecursionError:
        raise InvalidRequest("body is not JSON this service reads: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4,300)
        raise InvalidRequest(f"body is not JSON this service reads: {exc}") from exc


def _object(value: object, where: str, allowed: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON object")
    for key in value:
        if key not in allowed:
            hint = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            fix = f" (did you mean '{hint[0]}'?)" if hint else f" (allowed: {', '.join(allowed)})"
            raise InvalidRequest(f"{where}: unknown field '{key}'{fix}")
    return value


def _list(document: Mapping[str, Any], key: str) -> list[Any]:
    value = document.get(key)
    if not isinstance(value, list):
        raise InvalidRequest(f"{key} must be a list")
    return value


def _string(document: Mapping[str, Any], key: str, where: str = "") -> str:
    name = f"{where}.{key}" if where else key
    value = document.get(key)
    if value is None:
        raise InvalidRequest(f"{name} is missing")
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {json.dumps(value)}")
    return value


def _optional_string(document: Mapping[str, Any], key: str, where: str) -> str | None:
    """A string, or None when absent or null; an empty string is refused (say nothing instead)."""
    if document.get(key) is None:
        return None
    value = _string(document, key, where)
    if not value:
        name = f"{where}.{key}" if where else key
        raise InvalidRequest(f"{name} must not be empty (leave it out for none)")
    return value
