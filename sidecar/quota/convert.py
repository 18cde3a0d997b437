"""The RLQS protobuf edge (`envoy.service.rate_limit_quota.v3`): usage reports in, bucket actions
out.

A bucket id becomes a plain dict; an `Assignment` becomes a `QuotaAssignmentAction` (a blanket
rule or a token bucket with its `assignment_time_to_live`). The service wraps these actions in
its responses; the allocator, the buckets and the store never see protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envoy.service.rate_limit_quota.v3.rlqs_pb2 import (  # type: ignore[import-untyped]
    BucketId,
    RateLimitQuotaResponse,
)
from envoy.type.v3.ratelimit_strategy_pb2 import RateLimitStrategy  # type: ignore[import-untyped]

from sidecar.errors import InvalidRequest
from sidecar.quota.allocator import Assignment, Blanket
from sidecar.quota.buckets import MAX_ENTRIES

#: Longest key or value of a bucket id entry.
MAX_PART = 1_024
#: Most requests one report may count for a bucket (2**48: a million a second for 8 years; a
#: store's counters are 64-bit).
MAX_COUNT = 2**48

#: `RateLimitQuotaResponse.BucketAction` (protobuf messages are untyped here: `Any`).
BucketAction = RateLimitQuotaResponse.BucketAction


@dataclass(frozen=True, slots=True)
class Usage:
    """One bucket's line of a usage report: its id (sorted entries, hashable) and counts."""

    bucket: tuple[tuple[str, str], ...]
    allowed: int
    denied: int


def usages(message: Any) -> list[Usage]:
    """The report's lines; raises InvalidRequest for a line Envoy would not send (a bucket id
    empty, of more than MAX_ENTRIES entries or with a part longer than MAX_PART; a count above
    MAX_COUNT)."""
    lines = []
    for usage in message.bucket_quota_usages:
        entries = usage.bucket_id.bucket
        if not entries:
            raise InvalidRequest("a bucket_quota_usages entry has an empty bucket_id")
        if len(entries) > MAX_ENTRIES:
            raise InvalidRequest(
                f"a bucket_id has {len(entries)} entries; at most {MAX_ENTRIES} are accepted"
            )
        for key, value in entries.items():
            if len(key) > MAX_PART or len(value) > MAX_PART:
                raise InvalidRequest(f"a bucket_id entry is longer than {MAX_PART} characters")
        if max(usage.num_requests_allowed, usage.num_requests_denied) > MAX_COUNT:
            raise InvalidRequest(
                f"a bucket_quota_usages entry counts more than {MAX_COUNT} requests"
            )
        lines.append(
            Usage(
                tuple(sorted(entries.items())),
                usage.num_requests_allowed,
                usage.num_requests_denied,
            )
        )
    return lines


def bucket_id(bucket: tuple[tuple[str, str], ...]) -> Any:
    message = BucketId()
    for key, value in bucket:
        message.bucket[key] = value
    return message


def assignment_action(bucket: tuple[tuple[str, str], ...], assignment: Assignment) -> Any:
    """The action that gives `bucket` its assignment."""
    action = BucketAction(bucket_id=bucket_id(bucket))
    quota = action.quota_assignment_action
    quota.assignment_time_to_live.FromMilliseconds(assignment.ttl_ms)
    strategy = quota.rate_limit_strategy
    if assignment.blanket is Blanket.ALLOW_ALL:
        strategy.blanket_rule = RateLimitStrategy.ALLOW_ALL
    elif assignment.blanket is Blanket.DENY_ALL:
        strategy.blanket_rule = RateLimitStrategy.DENY_ALL
    else:
        bucket_message = strategy.token_bucket
        bucket_message.max_tokens = assignment.max_tokens
        bucket_message.tokens_per_fill.value = assignment.tokens_per_fill
        # Envoy 1.40 computes the rate from the whole seconds, but tells a new token bucket from
        # the one it has by max_tokens, tokens_per_fill and the *nanos* alone: the nanos repeat
        # the seconds, so a bucket whose interval changed is seen to change (a nanosecond per
        # second is nothing to an Envoy that reads them).
        bucket_message.fill_interval.seconds = assignment.fill_interval
        bucket_message.fill_interval.nanos = assignment.fill_interval
    return action


def assignment_actions(bucket: tuple[tuple[str, str], ...], assignment: Assignment) -> list[Any]:
    """The actions that give `bucket` its assignment. A `reset` one (a new lease block) comes
    after a DENY_ALL for the same bucket in the same response: Envoy 1.40 starts a changed token
    bucket as full as the one it replaces (a bucket that had spent half its tokens gets half of
    the new `max_tokens`; an empty one, none), and a token bucket that replaces a blanket rule
    full. Envoy applies a response's actions in order, before its workers see any of them, so
    the DENY_ALL is never enforced."""
    if not assignment.reset:
        return [assignment_action(bucket, assignment)]
    deny = Assignment(Blanket.DENY_ALL, assignment.ttl_ms)
    return [assignment_action(bucket, deny), assignment_action(bucket, assignment)]


def abandon_action(bucket: tuple[tuple[str, str], ...]) -> Any:
    """The action that tells Envoy to forget `bucket` (its rule was removed)."""
    action = BucketAction(bucket_id=bucket_id(bucket))
    action.abandon_action.SetInParent()
    return action
