"""The import graph of our packages (kvcache, models, streamsvc, client), read from the source with `ast`.

What counts as an edge `a -> b` (a, b dotted module names; a package is its `__init__.py`):

- every `import` statement anywhere in `a`: at the top, inside functions and methods, under
  `try:` and under `if TYPE_CHECKING:`. Type-only imports count: they cost nothing at run time,
  but they couple the modules all the same, and a cycle through them is one a refactor turns into
  an ImportError. (Dynamic imports, `importlib.import_module(...)`, are not seen.)
- `import b.c` is an edge to `b.c` (Python also runs `b/__init__.py` on the way; that implicit
  step to a parent package is not an edge, or every package re-exporting its submodules would be
  a cycle).
- `from b import c` is an edge to `b.c` when `b/c.py` (or `b/c/`) exists, else an edge to `b`,
  i.e. `b/__init__.py`, which is where a name that is not a submodule comes from. So a submodule
  importing a name from its own package's `__init__`, which re-exports that submodule's siblings,
  closes a cycle.
- relative imports are resolved against the importing module's package.

Only imports of our four packages are edges; each must resolve to a file of the tree.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "models", "streamsvc", "client")
# the wire (streamsvc/wire/): all that the client may use of the service
WIRE = frozenset({"streamsvc.wire", "streamsvc.wire.protocol", "streamsvc.wire.rtc", "streamsvc.wire.errors",
                  "streamsvc.wire.framing", "streamsvc.wire.image"})
MAX_TOP_LEVEL_MODULES = 8  # issue 42: streamsvc/ is packages by layer, with few modules beside them
MAX_SERVICE_MODULE_LINES = 600  # issue 32's bound on a module under streamsvc/


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # "path:line" of the import statement

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.where})"


def find_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` under `root`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> tuple[list[Edge], list[str]]:
    """The edges from `module` (its file: `path`) in the order of its lines, and the imports of ours
    that resolve to no module of `modules` ("path:line name")."""
    is_package = path.name == "__init__.py"
    rel = path.relative_to(ROOT) if path.is_absolute() and path.is_relative_to(ROOT) else path
    ours = {name.split(".")[0] for name in modules}
    edges, unresolved = [], []

    def add(target: str, node: ast.stmt) -> None:
        where = f"{rel}:{node.lineno}"
        if target.split(".")[0] not in ours:
            return
        if target in modules:
            edges.append(Edge(module, target, where))
        else:
            unresolved.append(f"{where} {target}")

    tree = ast.parse(path.read_text(), str(path))
    statements = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    for node in sorted(statements, key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
            continue
        base = node.module
        if node.level:  # relative: from the package holding `module`, up level - 1
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            add(sub if alias.name != "*" and sub in modules else base, node)
    return edges, unresolved


def build_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> tuple[dict[str, list[Edge]], list[str]]:
    """Module -> its edges (one per target: the first import of it), and every unresolved import."""
    modules = find_modules(root, packages)
    graph, unresolved = {}, []
    for module, path in modules.items():
        edges, missing = imports_of(module, path, modules)
        first = {}
        for e in edges:
            if e.target != module:  # a package's __init__ naming itself (`from pkg import x`) is no edge
                first.setdefault(e.target, e)
        graph[module] = list(first.values())
        unresolved += missing
    return graph, unresolved


def cycles(graph: dict[str, list[Edge]]) -> list[tuple[set[str], list[Edge]]]:
    """Every group of more than one module that reach one another (a strongly connected component,
    by Tarjan's algorithm), with a shortest cycle through its first module."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            if e.target not in index:
                visit(e.target)
                low[v] = min(low[v], low[e.target])
            elif e.target in on_stack:
                low[v] = min(low[v], index[e.target])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    found = []
    for component in components:  # breadth first from the component's first module back to itself
        start = min(component)
        came_by: dict[str, Edge] = {}
        frontier = [start]
        while start not in came_by:
            reached = []
            for v in frontier:
                for e in graph[v]:
                    if e.target in component and e.target not in came_by:
                        came_by[e.target] = e
                        reached.append(e.target)
            frontier = reached
        path, v = [], start
        while True:
            path.append(came_by[v])
            v = came_by[v].source
            if v == start:
                break
        found.append((component, path[::-1]))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Edge]]:
    return build_graph()[0]


def _package(module: str) -> str:
    return module.split(".")[0]


def test_every_import_of_ours_resolves_to_a_module():
    assert build_graph()[1] == [], "imports of our packages that name no module of the tree"


def test_no_import_cycles(graph):
    """Each cycle is reported with every import among the modules on cycles with it: those to break."""
    reports = []
    for members, cycle in cycles(graph):
        inside = [str(e) for m in sorted(members) for e in graph[m] if e.target in members]
        reports.append(
            " -> ".join([cycle[0].source] + [e.target for e in cycle])
            + f"\n  imports among {', '.join(sorted(members))}:\n    " + "\n    ".join(inside)
        )
    assert not reports, f"{len(reports)} import cycle(s):\n\n" + "\n\n".join(reports)


def test_dependencies_point_one_way(graph):
    """kvcache <- models <- streamsvc; only streamsvc/cli.py reaches into client (for loadtest)."""
    below = {"kvcache": set(), "models": {"kvcache"}, "streamsvc": {"kvcache", "models"}}
    wrong = [
        str(e) for edges in graph.values() for e in edges
        if _package(e.source) in below and _package(e.target) != _package(e.source)
        and _package(e.target) not in below[_package(e.source)]
        and not (e.source == "streamsvc.cli" and _package(e.target) == "client")
    ]  # fmt: skip
    assert not wrong, "imports against the direction kvcache <- models <- streamsvc:\n" + "\n".join(wrong)


def test_client_uses_only_the_wire_modules(graph):
    wrong = [str(e) for m, edges in graph.items() if _package(m) == "client" for e in edges
             if _package(e.target) != "client" and e.target not in WIRE]
    assert not wrong, f"client may use only {sorted(WIRE)} of ours:\n" + "\n".join(wrong)


def test_wire_modules_import_nothing_else_of_ours(graph):
    """Nor does `streamsvc/__init__.py`, which importing them runs: a client loads no more of ours."""
    allowed = WIRE | {"streamsvc"}
    wrong = [str(e) for m in sorted(allowed) for e in graph[m] if e.target not in allowed]
    assert not wrong, "the wire modules must stay free of the rest of the tree:\n" + "\n".join(wrong)


def test_service_modules_stay_small():
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in sorted((ROOT / "streamsvc").rglob("*.py"))}
    over = {str(p): n for p, n in sizes.items() if n > MAX_SERVICE_MODULE_LINES}
    assert not over, f"modules under streamsvc/ over {MAX_SERVICE_MODULE_LINES} lines: {over}"


def test_streamsvc_is_packages_by_layer_each_naming_its_modules():
    """At most MAX_TOP_LEVEL_MODULES modules at streamsvc/'s top level (its __init__ among them); every package's
    docstring names each of its modules (`name`), so that a reader finds a room's contents in one place."""
    top = sorted(p.name for p in (ROOT / "streamsvc").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at streamsvc/'s top level: {top}"
    unnamed = {}
    for init in sorted((ROOT / "streamsvc").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = [p.stem for p in sorted(init.parent.glob("*.py")) if p.stem != "__init__"]
        missing = [m for m in modules if f"`{m}`" not in doc]
        if missing:
            unnamed[init.parent.name] = missing
    assert not unnamed, f"packages whose docstring does not name these modules: {unnamed}"


def test_model_cache_and_client_modules_stay_small():
    """Issue 42's bound on the other packages: the same 600 lines."""
    paths = sorted(p for package in ("models", "kvcache", "client") for p in (ROOT / package).rglob("*.py"))
    over = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_SERVICE_MODULE_LINES}
    assert not over, f"modules under models/, kvcache/ or client/ over {MAX_SERVICE_MODULE_LINES} lines: {over}"


# -- private names: a module uses its own, and another's public API -----------------------------

# `x._name` where x is not `self`, `cls` or `super()`, allowed only as these (other packages' names, each with why)
PRIVATE_ALLOWED = {
    "torch._addmm_activation": "the fused matmul + bias + GELU of the DiT's feed-forward (models/dit.py): no public op",
    "torch._dynamo": "torch.compile's recompile limit (models/dit_ops.py) is set in its config only",
    "torch._scaled_mm": "the FP8 matmul of the FP8 linears (models/fp8.py): torch has no public one",
    "torch._foreach_copy_": "a graph's text inputs and a style's buffers copied in one launch (models/graphs.py, "
                            "models/adapters.py): no public op",
    "torch._foreach_zero_": "a style's buffers' rows a wider one left, zeroed in one launch (models/adapters.py): no "
                            "public op",
    "os._exit": "public despite its name: the documented exit without cleanup (streamsvc/engine/group.py)",
}
PRIVATE_HOOKS = "_hooks.py"  # streamsvc/**/*_hooks.py hold our private hooks into aiortc, aioice and aiohttp


def private_reaches(path: Path, packages: tuple[str, ...] = PACKAGES, root: Path = ROOT) -> list[str]:
    """"path:line: expression" for each private name of another object or module that `path` uses: an
    attribute `x._name` (one leading underscore) where x is not `self`, `cls` or `super()`, and
    `from <ours> import _name`, relative imports included (`from .stream import _name`)."""
    rel = path.relative_to(root) if path.is_relative_to(root) else path
    found = []
    nodes = ast.walk(ast.parse(path.read_text(), str(path)))
    for node in sorted(nodes, key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if ast.unparse(node) not in PRIVATE_ALLOWED:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.level or node.module.split(".")[0] in packages):
            found += [f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}"
                      for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_reach():
    """No module reaches into another class's or module's private names (but for PRIVATE_ALLOWED, and in the
    streamsvc/ modules named *_hooks.py, which exist to hold the hooks into the libraries' private names)."""
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
             if not (p.name.endswith(PRIVATE_HOOKS) and p.is_relative_to(ROOT / "streamsvc"))]
    found = [line for p in paths for line in private_reaches(p)]
    assert not found, f"{len(found)} private name(s) of another object or module used:\n" + "\n".join(found)


# -- the rules above, on a made-up tree ---------------------------------------------------------


def test_edges_follow_the_rules(tmp_path):
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "A = 1\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": (
            "from typing import TYPE_CHECKING\n"
            "from pkg import a\n"  # a submodule: edge to pkg.a
            "from pkg import A\n"  # a name: edge to pkg (its __init__)
            "from . import c\n"  # relative, a submodule: pkg.sub.c
            "from .. import a as again\n"  # relative, up one: pkg.a
            "if TYPE_CHECKING:\n    import pkg.sub.d\n"
            "def f():\n    from pkg.sub.c import C\n    import os\n"
            "import pkg.missing\n"
        ),
        "pkg/sub/c.py": "C = 1\n",
        "pkg/sub/d.py": "from pkg.sub import b\n",  # closes pkg.sub.b -> pkg.sub.d -> pkg.sub.b
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = find_modules(tmp_path, ("pkg",))
    assert sorted(modules) == ["pkg", "pkg.a", "pkg.sub", "pkg.sub.b", "pkg.sub.c", "pkg.sub.d"]
    edges, unresolved = imports_of("pkg.sub.b", modules["pkg.sub.b"], modules)
    assert [(e.target, int(e.where.rsplit(":", 1)[1])) for e in edges] == [
        ("pkg.a", 2), ("pkg", 3), ("pkg.sub.c", 4), ("pkg.a", 5), ("pkg.sub.d", 7), ("pkg.sub.c", 9)
    ]  # fmt: skip
    assert [u.rsplit(" ", 1)[1] for u in unresolved] == ["pkg.missing"]
    graph, _ = build_graph(tmp_path, ("pkg",))
    assert [(sorted(members), [e.source for e in cycle]) for members, cycle in cycles(graph)] == [
        (["pkg.sub.b", "pkg.sub.d"], ["pkg.sub.b", "pkg.sub.d"])
    ]


def test_private_reaches_follow_the_rules(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import os, torch\n"
        "from pkg.a import _hidden, shown\n"  # ours: _hidden
        "from . import _sibling\n"  # relative: checked too
        "from other import _theirs\n"  # not ours (the attribute rule sees its uses)
        "class C(B):\n"
        "    def f(self, x):\n"
        "        self._a, x._b = super()._c, type(self)._d\n"  # x._b and type(self)._d
        "        return x.__dict__, cls._e, torch._scaled_mm(x), os._exit\n"  # all allowed
    )
    assert private_reaches(path, ("pkg",), tmp_path) == [
        "m.py:2: from pkg.a import _hidden", "m.py:3: from . import _sibling", "m.py:7: x._b",
        "m.py:7: type(self)._d"
    ]


def test_the_scheduler_imports_without_torch():
    """The scheduler is pure: importing it (and the forward kinds it shares with the generator, models.work) loads
    neither torch nor the model."""
    import subprocess
    import sys

    code = ("import sys, streamsvc.scheduling, models.work; "
            "print(sorted(m for m in ('torch', 'models.generator', 'models.stream') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
