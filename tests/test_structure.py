"""The package layout is the request's path, and the imports keep to it: read from the sources
with `ast` (nothing is imported), every module under sidecar/ but the generated sidecar/proto.

`LAYERS` lists the packages from the values every layer shares up to the command line, as
README's Layout does. A module imports its own layer or the layers below it, never one above:
a lower layer never imports a higher one. No import goes round in a circle either, even within
a package.
A module imports another's public names only: when a neighbour needs a private helper
(`_name`), the seam is in the wrong place. Every import counts, at the top of a module, inside
a function (imported late to start faster) or under TYPE_CHECKING: each is a dependency a
reader has to follow.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDECAR = ROOT / "sidecar"

#: The layers, from the bottom up, in the order README's Layout lists them: a module imports
#: modules of its own entry or of entries before it, never of one after it. An entry is a
#: package (standing for every module under it) or a module. A new module goes in the package
#: of its layer; a new package gets an entry where its imports put it.
LAYERS: tuple[str, ...] = (
    # What every layer shares: the version, values, errors, the event loop's conventions, the
    # build's list of compiled modules.
    "sidecar",
    "sidecar.model",
    "sidecar.errors",
    "sidecar.loop",
    "sidecar.build",
    # Pure step functions, and when windows start and end.
    "sidecar.algorithms",
    # The rules core: rules, matching, lists, counter names and keys, usage dimensions.
    "sidecar.core",
    # Where counters live: memory, Redis, Redis Cluster.
    "sidecar.storage",
    # The decision path: a request planned, decided by one backend call, counted.
    "sidecar.decision",
    # What the sidecar tells about itself: metrics, statsd, tracing, logs.
    "sidecar.telemetry",
    # Envoy's edges: the frequency caps (served on the RLS gRPC port too), RLS, RLQS (whose
    # errors take RLS's statuses), rules over xDS.
    "sidecar.frequency",
    "sidecar.rls",
    "sidecar.quota",
    "sidecar.xds",
    # What people ask over HTTP: usage and refusals reported, the HTTP port, the operator's
    # counters (on a listener built as the HTTP port's are).
    "sidecar.reports",
    "sidecar.http",
    "sidecar.operator",
    # Programs beside the serving path: the Kubernetes injector (its webhook an HTTP listener
    # too), the envoy-config generator.
    "sidecar.injector",
    "sidecar.envoy_config",
    # The running sidecar: its parts built from its options, started and stopped; its workers.
    "sidecar.runner",
    # The command line: every command, the reference's settings mapped onto serve's flags, and
    # `python -m sidecar`.
    "sidecar.cli",
    "sidecar.__main__",
)

#: Layers whose modules must not import these libraries (STYLE.md: the core imports neither
#: grpc, protobuf nor redis; only the edges and the storage do).
PURE = ("sidecar.model", "sidecar.errors", "sidecar.algorithms", "sidecar.core", "sidecar.decision")
EDGE_LIBRARIES = ("grpc", "google.protobuf", "redis", "envoy", "xds")


@dataclass(frozen=True)
class Import:
    """One import of a sidecar module by another, where it stands."""

    importer: str
    line: int
    module: str
    #: The names taken from it (`from module import a, b`), empty for `import module`.
    names: tuple[str, ...]

    def where(self) -> str:
        return f"{self.importer.replace('.', '/')}.py:{self.line}"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module under root/sidecar (packages by their `__init__`), but the generated stubs."""
    found = {}
    for path in sorted((root / "sidecar").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[:2] == ["sidecar", "proto"]:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imports(known: dict[str, Path]) -> Iterator[Import]:
    """Every import of a sidecar module in the modules `known`: `from package import module`
    is an import of the module, `from module import name` one of the module."""
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "sidecar" or alias.name.startswith("sidecar."):
                        yield Import(name, node.lineno, alias.name, ())
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, module] if module else base)
                if module != "sidecar" and not module.startswith("sidecar."):
                    continue
                plain = tuple(a.name for a in node.names if f"{module}.{a.name}" not in known)
                for alias in node.names:
                    if f"{module}.{alias.name}" in known:
                        yield Import(name, node.lineno, f"{module}.{alias.name}", ())
                if plain:
                    yield Import(name, node.lineno, module, plain)


def layer(module: str) -> int | None:
    """The index in LAYERS of the entry holding `module` (the longest), None if none does."""
    best: int | None = None
    for index, entry in enumerate(LAYERS):
        # The root package stands for itself alone (its `__version__`), not for all.
        inside = entry != "sidecar" and module.startswith(entry + ".")
        if (module == entry or inside) and (best is None or len(entry) > len(LAYERS[best])):
            best = index
    return best


def upward(known: dict[str, Path]) -> list[str]:
    """Each import that runs back up, as `file:line: a (layer) imports b (layer)`."""
    found = []
    for edge in imports(known):
        low, high = layer(edge.importer), layer(edge.module)
        if low is not None and high is not None and high > low:
            found.append(
                f"{edge.where()}: {edge.importer} ({LAYERS[low]}) imports {edge.module}, "
                f"a layer above it ({LAYERS[high]})"
            )
    return found


def circles(known: dict[str, Path]) -> list[list[str]]:
    """The import circles: each group of modules that import one another round (Tarjan's
    strongly connected components of more than one module, or one importing itself)."""
    graph: dict[str, set[str]] = {name: set() for name in known}
    for edge in imports(known):
        if edge.module in graph:
            graph[edge.importer].add(edge.module)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in graph[node]:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(known: dict[str, Path]) -> list[str]:
    """Each private name one module takes from another: `from m import _x`, `import m._x`, or
    `m._x` read through a module bound by `from package import m` or `import m as name`."""
    found = []
    for edge in imports(known):
        taken = [n for n in edge.names if _private(n)]
        taken += [part for part in edge.module.split(".") if _private(part)]
        found += [f"{edge.where()}: {edge.importer} imports {name}" for name in taken]
    for name, path in known.items():
        tree = _parse(path)
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sidecar"):
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in known:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in known:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _private(node.attr)
            ):
                found.append(
                    f"{name.replace('.', '/')}.py:{node.lineno}: {name} reads "
                    f"{bound[node.value.id]}.{node.attr}"
                )
    return found


def test_every_module_has_a_place_in_the_layers() -> None:
    """Each module under sidecar/ belongs to a row of LAYERS, so a new module (at the top of
    sidecar/ or in a new package) is placed on the request's path on purpose."""
    known = modules()
    assert len(known) > 100  # the walk found the package, not an empty directory
    assert [name for name in known if layer(name) is None] == []


def test_no_import_runs_back_up() -> None:
    """No module imports a module of a layer above its own: the storage never reaches into the
    decision path, the rules core never into the storage, nothing below into the runner."""
    assert upward(modules()) == []


def test_no_import_circle() -> None:
    """No module imports itself back through others: the graph of imports has no circle."""
    assert circles(modules()) == []


def test_no_private_name_is_imported_across_modules() -> None:
    """No module takes another's private name (`_name`), by import or through its module."""
    assert private_imports(modules()) == []


def test_the_core_imports_no_edge_library() -> None:
    """The values, the algorithms, the rules core and the decision path import neither grpc,
    protobuf, Envoy's messages nor redis (STYLE.md): only the edges and the storage do."""
    found = []
    for name, path in modules().items():
        if not any(name == pure or name.startswith(pure + ".") for pure in PURE):
            continue
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            for target in targets:
                if any(target == lib or target.startswith(lib + ".") for lib in EDGE_LIBRARIES):
                    found.append(f"{name} imports {target} (line {node.lineno})")
    assert found == []


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """On a made-up package, each check reports its violation: an upward import, a circle, a
    private name taken by import and through a module."""
    package = tmp_path / "sidecar"
    for folder in ("core", "decision"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "core" / "rules.py").write_text("from sidecar.decision import limiter\n")
    (package / "decision" / "limiter.py").write_text(
        "from sidecar.core.rules import _tree\nfrom sidecar.core import rules\nrules._tree\n"
    )
    known = modules(tmp_path)
    assert upward(known) == [
        "sidecar/core/rules.py:1: sidecar.core.rules (sidecar.core) imports "
        "sidecar.decision.limiter, a layer above it (sidecar.decision)"
    ]
    assert circles(known) == [["sidecar.core.rules", "sidecar.decision.limiter"]]
    assert private_imports(known) == [
        "sidecar/decision/limiter.py:1: sidecar.decision.limiter imports _tree",
        "sidecar/decision/limiter.py:3: sidecar.decision.limiter reads sidecar.core.rules._tree",
    ]


def _readme_layout() -> list[str]:
    """The entries of README's Layout under `sidecar/`, in its order: each line's names before
    its text."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    tree = block.split("\ntests/", 1)[0]
    names = []
    for line in tree.splitlines():
        match = re.match(r"^  (\S.*?)(?:\s{2,}|$)", line)
        if match:
            names += [part.strip() for part in match.group(1).split(",")]
    return names


def test_readme_layout_is_the_tree() -> None:
    """README's Layout names exactly the packages and top-level modules of sidecar/ (and the
    page's folder, ui/), and its packages and modules in the order of LAYERS: the map stays
    the territory."""
    top = {
        path.name + "/" if path.is_dir() else path.name
        for path in SIDECAR.iterdir()
        if path.name not in ("__pycache__", "__init__.py")
        and (path.is_dir() or path.suffix == ".py")
    }
    listed = _readme_layout()
    assert set(listed) == top
    order = [f"sidecar.{name.removesuffix('/').removesuffix('.py')}" for name in listed]
    assert [name for name in order if name in LAYERS] == [e for e in LAYERS if e != "sidecar"]
