"""Manifest files for `ratelimit-sidecar inject`: YAML documents in, the same with the sidecar out.

Documents that are not a Pod or a workload (a Service, a ConfigMap) come out as they went in,
so a whole file can be piped through, as with `istioctl kube-inject`. The output is YAML as
PyYAML writes it: comments are not kept, and injecting the output again prints it unchanged.
"""

from __future__ import annotations

from typing import Any

import yaml

from sidecar.errors import InjectionError
from sidecar.injector.patch import inject
from sidecar.injector.settings import Settings


def inject_yaml(text: str, settings: Settings, source: str = "<stdin>") -> str:
    """Every document of `text` with the sidecar injected where it is asked for.

    Raises InjectionError naming `source`, the document and the fault.
    """
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise InjectionError(f"{source}: not valid YAML: {exc}") from None
    injected = []
    for index, document in enumerate(documents, start=1):
        try:
            injected.append(inject(document, settings))
        except InjectionError as exc:
            raise InjectionError(f"{source}: document {index} ({_name(document)}): {exc}") from None
    return yaml.dump_all(injected, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


class _Dumper(yaml.SafeDumper):
    """Writes every value out in full: no ``&id001`` anchors where objects are shared."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _name(document: Any) -> str:
    if not isinstance(document, dict):
        return type(document).__name__
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return f"{document.get('kind')} {name}"
