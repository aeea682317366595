"""The layering rule, "arrows only down": cli / bench / entrypoints -> engine -> executor ->
worker -> config -> model -> attention -> the leaf modules (step_types, sampling_params,
distributed, ...). A module may import its own layer and the layers below it, never one
above; the engine reaches the ranks only through the executor (it imports nothing from worker/);
no modules import each other in a circle, and no folders do.

Folders: the parts of a package are its `__init__` (its public face, free to re-export what lies
below it), each subpackage with everything under it, and the package's own modules taken
together; the root package's modules (cli, step_types, sampling_params, ...) stand in different
layers, so each of them is a part of its own. An import from one part of a package to another is an
arrow between the two (a subpackage's imports of its parent's modules or of its parent's
`__init__` included), and in no package do these arrows go round in a circle. So, for instance,
the backends (`attention/backends/`) import the contract in `attention/`, and nothing in
`attention/` itself imports a backend.

Every module under src/attnserve is parsed with `ast`; every import statement counts, at module
level or inside a function (or under TYPE_CHECKING). `from pkg import name` is an import of the
submodule `pkg.name` when there is one, else of the package `pkg` itself.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import attnserve

PACKAGE = Path(attnserve.__file__).parent
ROOT = PACKAGE.name
STEP_TYPES = f"{ROOT}.step_types"

ImportGraph = dict[str, set[str]]

# Top to bottom: the top-level packages and modules of each layer. A module in none of them (the
# package itself, cli, bench, entrypoints) is in the top layer.
LAYERS: list[tuple[str, ...]] = [
    ("engine",),
    ("executor",),
    ("worker",),
    ("config",),
    ("lora",),
    ("model",),
    ("attention",),
    (
        "step_types",
        "sampling_params",
        "output_constraints",
        "outputs",
        "distributed",
        "host_copy",
        "profiling",
        "native",
        "spec_decode",
    ),
]
# (importer, what it may not import although it lies below)
SKIPS: list[tuple[str, tuple[str, ...]]] = [("engine", ("worker",))]


def module_name(path: Path, package: Path) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _base(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    anchor = importer.split(".")
    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def imported_modules(tree: ast.AST, importer: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that `tree` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, importer, is_package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {name for name in found if name in known and name != importer}


def import_graph(package: Path) -> ImportGraph:
    paths = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    known = set(paths)
    return {
        name: imported_modules(
            ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known
        )
        for name, path in paths.items()
    }


def package_names(package: Path) -> set[str]:
    return {module_name(path, package) for path in package.rglob("__init__.py")}


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def part_of(package: str, module: str, packages: set[str]) -> str:
    """The part of `package` that holds `module` (a module inside it): the package's `__init__`
    (`package.__init__`), a subpackage with everything under it, or the package's own modules
    taken together (`package.*`), except in the root package, whose modules are parts of their
    own."""
    if module == package:
        return f"{package}.__init__"
    child = f"{package}.{module[len(package) + 1 :].split('.')[0]}"
    if child in packages or "." not in package:
        return child
    return f"{package}.*"


def folder_graphs(graph: ImportGraph, packages: set[str]) -> dict[str, ImportGraph]:
    """Per package, the imports between its parts (`part_of`)."""
    levels: dict[str, ImportGraph] = {}
    for importer, imported in graph.items():
        for target in imported:
            for package in packages:
                if not (_inside(importer, package) and _inside(target, package)):
                    continue
                source, sink = (
                    part_of(package, importer, packages),
                    part_of(package, target, packages),
                )
                if source != sink:
                    level = levels.setdefault(package, {})
                    level.setdefault(source, set()).add(sink)
                    level.setdefault(sink, set())
    return levels


def folder_cycles(graph: ImportGraph, packages: set[str]) -> list[list[str]]:
    """One cycle per strongly connected group of parts, in every package."""
    levels = folder_graphs(graph, packages)
    return [cycle for _, level in sorted(levels.items()) for cycle in find_cycles(level)]


def find_cycles(graph: ImportGraph) -> list[list[str]]:
    """One cycle (a path back to its first module) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

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
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: ImportGraph, group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise ValueError(f"no cycle through {start} in its group")


def _top_level(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(module: str) -> int:
    """0 for the top layer, then 1, 2, ... down `LAYERS`."""
    top = _top_level(module)
    return next((i for i, names in enumerate(LAYERS, 1) if top in names), 0)


def _describe(module: str) -> str:
    layer = layer_of(module)
    return f"{module} (layer {'/'.join(LAYERS[layer - 1]) if layer else 'top'})"


def forbidden_imports(graph: ImportGraph) -> Iterator[str]:
    """Each import of a module in a layer above the importer's, or named in `SKIPS`."""
    for importer, imported in sorted(graph.items()):
        skipped = [banned for name, banned in SKIPS if _top_level(importer) == name]
        for target in sorted(imported):
            if layer_of(target) < layer_of(importer):
                yield f"{_describe(importer)} imports {_describe(target)}, above it"
            elif any(_top_level(target) in banned for banned in skipped):
                yield f"{importer} imports {target}: it must go through the layer between"


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return import_graph(PACKAGE)


def test_no_import_cycles(graph: ImportGraph) -> None:
    cycles = [" -> ".join(cycle) for cycle in find_cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_folder_cycles(graph: ImportGraph) -> None:
    cycles = [" -> ".join(cycle) for cycle in folder_cycles(graph, package_names(PACKAGE))]
    assert not cycles, "folder cycles:\n" + "\n".join(cycles)


def test_no_upward_imports(graph: ImportGraph) -> None:
    found = list(forbidden_imports(graph))
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_the_step_types_module_is_a_leaf(graph: ImportGraph) -> None:
    """step_types, below engine, executor, worker and model alike, imports only
    sampling_params."""
    assert graph.get(STEP_TYPES) == {f"{ROOT}.sampling_params"}


def _write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_see_cycles_and_upward_imports(tmp_path: Path) -> None:
    package = _write(
        tmp_path / ROOT,
        {
            "__init__.py": "",
            "step_types.py": "from attnserve.model import config\n",
            "model/__init__.py": "from attnserve.model import config\n",
            "model/config.py": "def f():\n    from attnserve.model.loader import load\n",
            "model/loader.py": "from . import config\nfrom ..worker import batch\n",
            "engine/__init__.py": "",
            "engine/step.py": "import attnserve.worker.batch\nfrom attnserve import cli\n",
            "worker/__init__.py": "",
            "worker/batch.py": "from attnserve.worker import batch\n",
            "cli.py": "",
        },
    )
    graph = import_graph(package)
    assert graph[f"{ROOT}.model"] == {f"{ROOT}.model.config"}
    assert graph[f"{ROOT}.model.loader"] == {f"{ROOT}.model.config", f"{ROOT}.worker.batch"}
    assert graph[f"{ROOT}.worker.batch"] == set()
    assert find_cycles(graph) == [
        [f"{ROOT}.model.config", f"{ROOT}.model.loader", f"{ROOT}.model.config"]
    ]
    assert list(forbidden_imports(graph)) == [
        f"{ROOT}.engine.step (layer engine) imports {ROOT}.cli (layer top), above it",
        f"{ROOT}.engine.step imports {ROOT}.worker.batch: it must go through the layer between",
        f"{ROOT}.model.loader (layer model) imports {ROOT}.worker.batch (layer worker), above it",
        f"{ROOT}.step_types (layer step_types/sampling_params/output_constraints/outputs/"
        f"distributed/host_copy/profiling/native/spec_decode) imports {ROOT}.model.config "
        "(layer model), "
        "above it",
    ]


def test_the_folder_check_sees_cycles_between_folders(tmp_path: Path) -> None:
    package = _write(
        tmp_path / ROOT,
        {
            "__init__.py": "def f():\n    from attnserve.entry import llm\n",
            "core.py": "",
            "entry/__init__.py": "",
            "entry/llm.py": "from attnserve import core\n",
            "entry/server.py": "from attnserve import __version__\n",
            "attn/__init__.py": "from attnserve.attn.backends import sdpa\n",
            "attn/selector.py": "from attnserve.attn.backends.abstract import Backend\n",
            "attn/scales.py": "",
            "attn/backends/__init__.py": "",
            "attn/backends/abstract.py": "from attnserve.attn import scales\n",
            "attn/backends/sdpa.py": "from .abstract import Backend\n",
        },
    )
    graph = import_graph(package)
    assert find_cycles(graph) == []
    packages = package_names(package)
    assert packages == {ROOT, f"{ROOT}.entry", f"{ROOT}.attn", f"{ROOT}.attn.backends"}
    assert folder_graphs(graph, packages)[ROOT] == {
        f"{ROOT}.__init__": {f"{ROOT}.entry"},
        f"{ROOT}.entry": {f"{ROOT}.core", f"{ROOT}.__init__"},
        f"{ROOT}.core": set(),
    }
    assert folder_cycles(graph, packages) == [
        [f"{ROOT}.__init__", f"{ROOT}.entry", f"{ROOT}.__init__"],
        [f"{ROOT}.attn.*", f"{ROOT}.attn.backends", f"{ROOT}.attn.*"],
    ]
