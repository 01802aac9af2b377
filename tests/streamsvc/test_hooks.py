"""What streamsvc uses below aiortc's, aioice's and aiohttp's APIs (issue 42, part 4), by name, against the installed
libraries: an upgrade that moves one fails here, loudly, before anything else does.

Each hook module (streamsvc/transport/aiortc_hooks.py, streamsvc/transport/aioice_hooks.py,
streamsvc/door/aiohttp_hooks.py) declares what it uses, ``HOOKED``: (module, class or None, name). Each name must
be in the installed library: a module attribute, a class attribute (a method, a slot, a class-level default), or an
instance attribute assigned in the class's ``__init__`` (or, for those in ``SET_ELSEWHERE``, in the module that
sets it). The installed minor version must be the one the module was tested against, and pyproject.toml must pin the
library below the next one.

And no other module of streamsvc/ uses one of those private names (those starting with ``_``, and private module
paths such as ``aiohttp._websocket``) in its code: an attribute of anything but ``self``/``cls`` (or of ``self`` in a
subclass of a class of those libraries), a method of such a subclass, an import, or a string (``getattr(x, "_y")``).
Comments and docstrings (any string statement) may name them: they say what the hook modules do for their module.
``_set_role`` is stricter: no other file under streamsvc/ contains it at all.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from streamsvc.door import aiohttp_hooks
from streamsvc.transport import aioice_hooks, aiortc_hooks

ROOT = Path(__file__).resolve().parents[2]
HOOK_MODULES = {
    Path("streamsvc/transport/aiortc_hooks.py"): aiortc_hooks,
    Path("streamsvc/transport/aioice_hooks.py"): aioice_hooks,
    Path("streamsvc/door/aiohttp_hooks.py"): aiohttp_hooks,
}
LIBRARIES = frozenset(m.LIBRARY for m in HOOK_MODULES.values())


def _is_defined(module_name: str, class_name: str | None, name: str, set_elsewhere: dict) -> bool:
    module = importlib.import_module(module_name)
    if class_name is None:
        return hasattr(module, name)
    cls = getattr(module, class_name)
    if hasattr(cls, name):
        return True
    written = name
    mangled = f"_{class_name.lstrip('_')}__"
    if name.startswith(mangled):
        written = "__" + name[len(mangled):]  # a name-mangled attribute: `self.__x` in the class's source
    assigned = re.compile(rf"\bself\.{re.escape(written)}\s*(?::[^=\n]*)?=(?!=)")
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if inspect.isfunction(init) and assigned.search(inspect.getsource(init)):
            return True
    where = set_elsewhere.get((module_name, class_name, name))
    if where is not None:
        setter = inspect.getsource(importlib.import_module(where))
        return re.search(rf"\.{re.escape(name)}\s*=(?!=)", setter) is not None
    return False


@pytest.mark.parametrize("hooks", HOOK_MODULES.values(), ids=lambda m: m.LIBRARY)
def test_every_hooked_name_is_in_the_installed_library(hooks):
    assert hooks.HOOKED and all(len(entry) == 3 for entry in hooks.HOOKED)
    set_elsewhere = getattr(hooks, "SET_ELSEWHERE", {})
    missing = [entry for entry in hooks.HOOKED if not _is_defined(*entry, set_elsewhere)]
    assert not missing, (f"{hooks.LIBRARY} {version(hooks.LIBRARY)} lacks {missing}: {hooks.__name__} was written for "
                         f"{hooks.TESTED_VERSION}; update it (and its pin in pyproject.toml)")


@pytest.mark.parametrize("hooks", HOOK_MODULES.values(), ids=lambda m: m.LIBRARY)
def test_the_installed_minor_version_is_the_tested_one_and_pyproject_pins_it(hooks):
    major, minor = (int(x) for x in hooks.TESTED_VERSION.split(".")[:2])
    installed = tuple(int(x) for x in version(hooks.LIBRARY).split(".")[:2])
    assert installed == (major, minor), (f"{hooks.LIBRARY} {version(hooks.LIBRARY)} is installed; {hooks.__name__} was "
                                         f"tested against {hooks.TESTED_VERSION}")
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in dependencies if re.match(rf"{hooks.LIBRARY}\b(?!-)", d)]
    assert len(pins) == 1 and f"<{major}.{minor + 1}" in pins[0], pins


# -- no private name of theirs elsewhere ---------------------------------------------------------------------------


def private_names(hooked) -> set[str]:
    """The private names of `hooked` (HOOKED entries): names and module path components that start with `_`."""
    names = {name for _, _, name in hooked if name.startswith("_")}
    return names | {part for module, _, _ in hooked for part in module.split(".") if part.startswith("_")}


def mangled_prefixes(hooked) -> set[str]:
    """`_Class__` for each class of `hooked` one of whose names is name-mangled."""
    return {f"_{cls}__" for _, cls, name in hooked if cls is not None and name.startswith(f"_{cls}__")}


class _Uses(ast.NodeVisitor):
    """Where a module's code uses one of `names` (see the module docstring)."""

    def __init__(self, names: set[str], prefixes: set[str], libraries: frozenset[str]) -> None:
        self.names, self.prefixes, self.libraries = names, prefixes, libraries
        self.theirs: set[str] = set()  # names bound by imports from the libraries
        self.derived: list[bool] = []  # the enclosing classes: does each derive from a class of theirs?
        self.found: list[tuple[int, str]] = []
        words = [rf"(?<!\w){re.escape(n)}(?!\w)" for n in sorted(names)] + [re.escape(p) for p in sorted(prefixes)]
        self._in_text = re.compile("|".join(words) or "(?!)")

    def _module_is_theirs(self, module: str | None) -> bool:
        return module is not None and module.split(".")[0] in self.libraries

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._module_is_theirs(alias.name):
                self.theirs.add(alias.asname or alias.name.split(".")[0])
            self._check_module(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self._check_module(node, node.module or "")
        for alias in node.names:
            if self._module_is_theirs(node.module):
                self.theirs.add(alias.asname or alias.name)
            if alias.name in self.names:
                self.found.append((node.lineno, f"import of {alias.name}"))

    def _check_module(self, node: ast.stmt, module: str) -> None:
        private = [part for part in module.split(".") if part in self.names]
        if private and self._module_is_theirs(module):
            self.found.append((node.lineno, f"import of {module}"))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        roots = []
        for base in node.bases:
            while isinstance(base, ast.Attribute):
                base = base.value
            roots.append(base.id if isinstance(base, ast.Name) else None)
        self.derived.append(any(root in self.theirs for root in roots))
        self.generic_visit(node)
        self.derived.pop()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if self.derived and self.derived[-1] and node.name in self.names:
            self.found.append((node.lineno, f"override of {node.name}"))
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.names:
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not own or any(self.derived):
                self.found.append((node.lineno, f".{node.attr}"))
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring (or any string statement): documentation
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and self._in_text.search(node.value):
            self.found.append((node.lineno, f"string {node.value[:60]!r}"))


def uses(source: str, names: set[str], prefixes: set[str] = frozenset(),
         libraries: frozenset[str] = LIBRARIES) -> list[tuple[int, str]]:
    visitor = _Uses(names, prefixes, libraries)
    visitor.visit(ast.parse(source))
    return sorted(visitor.found)


def test_no_module_but_the_hook_modules_uses_their_private_names():
    found = {}
    for path in sorted((ROOT / "streamsvc").rglob("*.py")):
        rel = path.relative_to(ROOT)
        own = [HOOK_MODULES[rel].HOOKED] if rel in HOOK_MODULES else []
        others = [m.HOOKED for p, m in HOOK_MODULES.items() if p != rel]
        names = set().union(*map(private_names, others)) - set().union(*map(private_names, own))
        prefixes = set().union(*map(mangled_prefixes, others)) - set().union(*map(mangled_prefixes, own))
        hits = uses(path.read_text(), names, prefixes)
        if hits:
            found[str(rel)] = hits
    assert not found, f"private names of aiortc, aioice or aiohttp outside their hook module: {found}"


def test_only_aiortc_hooks_contains_set_role():
    paths = sorted((ROOT / "streamsvc").rglob("*.py"))
    holders = [str(p.relative_to(ROOT)) for p in paths if "_set_role" in p.read_text()]
    assert holders == ["streamsvc/transport/aiortc_hooks.py"]


def test_the_scan_finds_uses_in_code_and_leaves_documentation_alone():
    names = private_names(aiortc_hooks.HOOKED) | private_names(aiohttp_hooks.HOOKED)
    prefixes = mangled_prefixes(aiortc_hooks.HOOKED)
    code = '''
"""Docstrings may say _set_role and _RTCRtpReceiver__decoder_thread."""
from aiortc.jitterbuffer import JitterBuffer
from aiohttp._websocket.reader import WebSocketReader
MANGLED = "_RTCRtpReceiver__"

class Ours:
    def __init__(self):
        self._origin = 0  # our own attribute of the same name: not theirs
        """an attribute docstring naming _packets"""

class Buffer(JitterBuffer):
    def _remove_frame(self, n):
        return self._packets[n]

def f(pc, receiver):
    pc._set_role("server")  # a comment may say _role
    return getattr(receiver, "_enabled")
'''
    assert [what for _, what in uses(code, names, prefixes)] == [
        "import of aiohttp._websocket.reader", "string '_RTCRtpReceiver__'", "override of _remove_frame", "._packets",
        "._set_role", "string '_enabled'"]
