"""What the webhook (or `inject`) decides for every pod, from its flags; annotations may override
the image, resources, user and native-or-ordinary choice per pod (see `annotations`).

Resource quantities are checked here as Kubernetes reads them (``100m``, ``1``, ``128Mi``,
``1.5G``), so a typo is refused with its name at start, not by the API server per pod.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from sidecar.injector.urls import validate_url

DEFAULT_IMAGE = "ratelimit-sidecar:0.1.0"
#: The rules ConfigMap a pod without ``ratelimit-sidecar/rules-configmap`` mounts, in its own
#: namespace (a missing one keeps the pod from starting, with an event naming it).
DEFAULT_RULES_CONFIGMAP = "ratelimit-rules"
#: The image's user (see the Dockerfile); set on the container too, so `runAsNonRoot` holds
#: whatever user the pod asks for.
SIDECAR_UID = 65532
#: After its preStop sleep (ordinary container) or once the pod's containers have exited
#: (native sidecar), the sidecar gets SIGTERM; this is what it may need to finish the calls in
#: flight (each bounded by the backend deadline) and exit.
DRAIN_SECONDS = 5
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
#: The first Kubernetes minor version whose kubelets run native sidecars by default (the
#: SidecarContainers feature, beta and on since 1.29).
NATIVE_SINCE = (1, 29)

DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+)?")
_SCALE: dict[str, Decimal | int] = {
    "": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def quantity(text: str) -> Decimal:
    """The value of a Kubernetes resource quantity; ValueError for anything else."""
    found = _QUANTITY.fullmatch(text) if len(text) <= 32 else None
    if found is None:
        raise ValueError(f"{text[:32]!r} is not a Kubernetes quantity (e.g. 100m, 1, 128Mi)")
    number, suffix = found.group(1), found.group(2) or ""
    try:
        value = Decimal(number)
        if suffix[:1] in ("e", "E"):
            return value * Decimal(10) ** int(suffix[1:])
        return value * _SCALE[suffix]
    except (InvalidOperation, OverflowError):
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 100m, 1, 128Mi)") from None


def check_resources(cpu: tuple[str, str], memory: tuple[str, str], where: str) -> None:
    """Each (request, limit) pair: quantities above zero, the request not above the limit."""
    for name, (request, limit) in (("cpu", cpu), ("memory", memory)):
        try:
            low, high = quantity(request), quantity(limit)
        except ValueError as exc:
            raise ValueError(f"{where}: {name}: {exc}") from None
        if low <= 0 or high <= 0:
            raise ValueError(f"{where}: {name} request and limit must be above 0")
        if low > high:
            raise ValueError(
                f"{where}: {name} request {request} is above its limit {limit} "
                "(the API server would refuse the pod)"
            )


def check_user(value: int, what: str) -> None:
    if not 1 <= value <= 2**31 - 1:
        raise ValueError(f"{what} must be a non-root id from 1 to 2147483647, not {value}")


@dataclass(frozen=True, slots=True)
class Settings:
    """The injector's defaults, from the `webhook` and `inject` flags.

    `default_backend` is used when a pod has no ``ratelimit-sidecar/backend`` annotation;
    None leaves the sidecar's own default (``memory://``, counters private to each pod).
    `rules_configmap` is mounted when a pod has no ``ratelimit-sidecar/rules-configmap``.
    `native_sidecars` injects the sidecar as an init container with ``restartPolicy: Always``
    (Kubernetes 1.29 and later) rather than as an ordinary container.
    `pre_stop_seconds` keeps an ordinary sidecar serving after the pod starts terminating, so
    Envoy, which stops sending when it exits, is gone before the sidecar stops answering.
    """

    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    default_backend: str | None = None
    rules_configmap: str = DEFAULT_RULES_CONFIGMAP
    pre_stop_seconds: int = 10
    native_sidecars: bool = True
    # Python serves gRPC from one event loop: a second core buys little, so one core is the
    # limit that never throttles it in practice, while memory is capped well above its working
    # set.
    cpu_request: str = "100m"
    cpu_limit: str = "1"
    memory_request: str = "128Mi"
    memory_limit: str = "256Mi"
    run_as_user: int = SIDECAR_UID
    run_as_group: int = SIDECAR_UID

    def __post_init__(self) -> None:
        if not self.image or len(self.image) > 512 or any(c.isspace() for c in self.image):
            raise ValueError(f"the sidecar image must be an image reference, not {self.image!r}")
        if self.image_pull_policy not in PULL_POLICIES:
            raise ValueError(
                f"image pull policy must be Always, IfNotPresent or Never, "
                f"not {self.image_pull_policy!r}"
            )
        if self.default_backend is not None:
            try:
                validate_url(self.default_backend)
            except ValueError as exc:
                raise ValueError(f"default backend: {exc}") from None
        if len(self.rules_configmap) > 253 or not DNS_SUBDOMAIN.fullmatch(self.rules_configmap):
            raise ValueError(
                f"rules ConfigMap: {self.rules_configmap[:64]!r} is not a ConfigMap name "
                "(lower-case letters, digits, '-' and '.', at most 253 characters)"
            )
        if not 0 <= self.pre_stop_seconds <= 300:
            raise ValueError(f"pre-stop seconds must be 0 to 300, not {self.pre_stop_seconds}")
        check_resources(
            (self.cpu_request, self.cpu_limit),
            (self.memory_request, self.memory_limit),
            "default resources",
        )
        check_user(self.run_as_user, "run-as-user")
        check_user(self.run_as_group, "run-as-group")

    @property
    def grace_seconds(self) -> int:
        """The least terminationGracePeriodSeconds that lets Envoy and then the sidecar drain."""
        return self.pre_stop_seconds + DRAIN_SECONDS
