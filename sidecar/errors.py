"""The sidecar's errors, one small hierarchy::

    SidecarError
    ├── ConfigError        a rules file is wrong: names the file, the path inside it and the fix
    ├── InvalidRequest     a request Envoy (or a client) sent cannot be answered
    │   └── NegativeHitsRefused   a refund (is_negative_hits) this sidecar does not take
    ├── UnknownDomain      a frequency-cap or operator call names a domain the rules lack
    ├── StorageError       a backend call failed or timed out; transient, the failure mode decides
    ├── Overloaded         the backend answers, but not this call in time
    ├── OverBound          a caller asked for more than a stated bound allows
    └── InjectionError     a pod (or manifest) cannot get a working sidecar from its annotations

The gRPC and HTTP statuses a call is answered with for each are in one table,
`sidecar.rls.statuses`. Callers chain with ``raise ... from exc`` so the cause stays visible in
logs.
"""

from __future__ import annotations


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose."""


class ConfigError(SidecarError):
    """A rules file cannot be loaded.

    ``str(err)`` reads ``FILE: PATH: message``, for example
    ``rules.yaml: descriptors[0]: unknown key 'ratelimit' (did you mean 'rate_limit'?)``.
    """

    def __init__(self, source: str, path: str, message: str) -> None:
        self.source = source
        self.path = path
        self.message = message
        where = f"{source}: {path}: " if path else f"{source}: "
        super().__init__(where + message)


class InvalidRequest(SidecarError):
    """A request that breaks the protocol's rules (empty domain, no descriptors, absurd hits_addend)."""


class NegativeHitsRefused(InvalidRequest):
    """A request carries a refund (`is_negative_hits`) and this sidecar does not take them
    (`--negative-hits` off, or `--rejected-hits skip`): refused whole, so that no refund is
    ever counted as a charge and no counter changes. UNIMPLEMENTED, as the reference's
    ENABLE_NEGATIVE_HITS (its #1230) answers it."""


class UnknownDomain(SidecarError):
    """A frequency-cap call names a domain no rules file declares, or one without `user` → `ad`
    rules, or an operator's counters call (`sidecar.operator.counter_admin`) names a domain no rules
    declare. Envoy's own service answers an unknown domain OK instead (the reference does), but
    an ad server or an operator asking about limits that do not exist has something to fix."""


class StorageError(SidecarError):
    """A backend call failed or missed its deadline.

    Always transient from the service's point of view: the request is answered by the failure
    mode, and the next request tries the backend again.
    """

    transient = True


class Overloaded(SidecarError):
    """The backend is answering, but not this call in time: it already had as many calls in
    flight as it answers within their deadline (the call is refused before it is sent), or
    the call's deadline passed while the backend kept answering the calls queued ahead of it
    (it may still be counted when the backend gets to it).

    Not a failure of the backend: the sidecar is being asked for more than it and its backend
    can decide in time. The call is answered UNAVAILABLE on gRPC and 503 on HTTP, and never by
    the failure mode: failing open here would let a flood of clients push admissions past any
    limit while Redis is healthy.
    """


class OverBound(SidecarError):
    """A caller asked for more than one of the sidecar's stated bounds allows (the buckets of
    one quota stream, `sidecar.quota.service.MAX_BUCKETS`); the message names the bound and how
    to stay under it. Not a rate limit: the caller's configuration is to change."""


class InjectionError(SidecarError):
    """A workload asks for the sidecar with annotations that cannot make a working one.

    ``str(err)`` names the annotation and the fix, for example
    ``ratelimit-sidecar/failure-mode: must be 'allow', 'deny' or 'local', not 'open'``; the webhook
    returns it as the admission message, so `kubectl` shows it to whoever applied the workload.
    """
