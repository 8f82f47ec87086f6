"""The package's boundaries, read from the import statements of its modules: the
policy is pure (no torch, asyncio or aiohttp) and its subpackages import only
downwards, the engine knows nothing of the coordinator, the simulator runs without
torch or asyncio, the configuration without torch, the protocol imports nothing above
it, and no two packages import each other, even through others; how parts are wired
(at most five collaborators, no callbacks into siblings at the composition roots);
the glossary's words where they are cheap to check; and no module grows past about
400 lines unnoticed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "vertumnus"


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # ``from package import module`` imports the module too.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("policy", ("torch", "asyncio", "aiohttp", "vertumnus.runtime", "vertumnus.sim")),
        ("engine", ("vertumnus.runtime", "vertumnus.server", "vertumnus.sim", "asyncio")),
        ("sim", ("torch", "asyncio", "aiohttp", "vertumnus.runtime", "vertumnus.engine")),
        ("config", ("torch", "asyncio", "vertumnus.runtime", "vertumnus.engine")),
    ],
)
def test_packages_keep_their_boundaries(package: str, forbidden: tuple[str, ...]) -> None:
    offences = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted((SRC / package).rglob("*.py"))
        for name in sorted(imports(path))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert offences == []


# The policy's layers, lowest first: each imports only the layers before it and the
# base modules at the top of ``policy/`` (the cost terms, the lattice's geometry and
# the lattice); the stack (the other top-level modules) sits above them all.
POLICY_BASE = ("costs", "geometry", "lattice")
POLICY_LAYERS = ("cache", "placement", "control")


def test_policy_layers_import_downwards() -> None:
    offences = []
    for index, layer in enumerate(POLICY_LAYERS):
        allowed = {*POLICY_BASE, *POLICY_LAYERS[: index + 1]}
        for path in sorted((SRC / "policy" / layer).rglob("*.py")):
            for name in sorted(imports(path)):
                parts = name.split(".")
                inside = parts[:2] == ["vertumnus", "policy"] and len(parts) > 2
                if inside and parts[2] not in allowed:
                    offences.append(f"{path.relative_to(SRC)} imports {name}")
    assert offences == []


def test_no_policy_part_holds_the_stack() -> None:
    """The stack's parts are given their collaborators, never the stack: besides the
    stack itself, only the timeline, which samples the stack it is passed, imports it."""
    offences = [
        str(path.relative_to(SRC))
        for path in sorted((SRC / "policy").rglob("*.py"))
        if path.name not in ("pool_policy.py", "timeline.py")
        and any(n.startswith("vertumnus.policy.pool_policy") for n in imports(path))
    ]
    assert offences == []


def test_only_the_composition_root_names_the_coordinator() -> None:
    """The runtime's parts are given their collaborators (and ``apply``), never the
    coordinator: only the coordinator itself, the REST API it serves and the command
    that builds it import it."""
    allowed = ("runtime/coordinator.py", "cli/serve.py")
    offences = [
        str(path.relative_to(SRC))
        for path in sorted(SRC.rglob("*.py"))
        if str(path.relative_to(SRC)) not in allowed
        and path.relative_to(SRC).parts[0] != "server"
        and any(n.startswith("vertumnus.runtime.coordinator") for n in imports(path))
    ]
    assert offences == []


def test_policy_layers_exist() -> None:
    """The layer test above checks real folders: every layer is a package with modules."""
    for layer in POLICY_LAYERS:
        modules = list((SRC / "policy" / layer).glob("*.py"))
        assert (SRC / "policy" / layer / "__init__.py") in modules
        assert len(modules) > 2


def test_modules_stay_readable() -> None:
    """About 400 lines at most: a module past that has more than one job to split."""
    long = {
        str(path.relative_to(SRC)): n
        for path in sorted(SRC.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 420
    }
    assert long == {}


# -- how parts are wired (issue 64) ------------------------------------------------------

PART_PACKAGES = ("policy", "runtime")
MAX_COLLABORATORS = 5


def constructor_arity(cls: ast.ClassDef) -> int | None:
    """The parameters of the class's own ``__init__`` besides ``self`` (None: none)."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            a = node.args
            starred = (a.vararg is not None) + (a.kwarg is not None)
            return len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs) + starred
    return None


def test_parts_take_few_collaborators() -> None:
    """A part is given the state it reads (one typed bundle) and a handful of
    collaborators, never a constructor of a dozen flags and callbacks."""
    offences = [
        f"{path.relative_to(SRC)}: {node.name} takes {n}"
        for package in PART_PACKAGES
        for path in sorted((SRC / package).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and (n := constructor_arity(node)) is not None
        and n > MAX_COLLABORATORS
    ]
    assert offences == []


def part_classes(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Every class of these packages -> its methods (not properties)."""
    classes: dict[str, set[str]] = {}
    for package in packages:
        for path in (SRC / package).rglob("*.py"):
            for cls in ast.walk(ast.parse(path.read_text())):
                if not isinstance(cls, ast.ClassDef):
                    continue
                methods = classes.setdefault(cls.name, set())
                for node in cls.body:
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not any(
                        ast.unparse(d).endswith(("property", "setter")) for d in node.decorator_list
                    ):
                        methods.add(node.name)
    return classes


# The composition roots: the stack over the policy's parts, the coordinator over the
# runtime's; each routes what its parts return.
ROOTS = ("policy/pool_policy.py", "runtime/coordinator.py")


def self_chain(node: ast.expr) -> list[str] | None:
    """``self.a.b`` -> ["a", "b"]; None where the chain is not rooted at ``self``."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return names[::-1] if isinstance(node, ast.Name) and node.id == "self" else None


def passed_callbacks(tree: ast.Module, classes: dict[str, set[str]]) -> list[str]:
    """Callables handed to a part: a lambda, a local function, a method of the root
    (``self.m``) or of a part (``self.part.m``), passed to a part's constructor or
    method, or assigned to another object's attribute."""
    root = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    root_methods = classes.get(root.name, set())
    parts = {  # self.x = SomePart(...)
        chain[0]: node.value.func.id
        for node in ast.walk(root)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id in classes
        for target in node.targets
        if (chain := self_chain(target)) is not None and len(chain) == 1
    }
    local_defs = {
        node.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
        if node is not fn and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }

    def offence(value: ast.expr) -> str | None:
        if isinstance(value, ast.Lambda):
            return "a lambda"
        if isinstance(value, ast.Name) and value.id in local_defs:
            return f"local function {value.id}"
        chain = self_chain(value)
        if chain is None:
            return None
        if len(chain) == 1 and chain[0] in root_methods:
            return f"the root's method self.{chain[0]}"
        if len(chain) == 2 and chain[1] in classes.get(parts.get(chain[0], ""), set()):
            return f"a part's method self.{chain[0]}.{chain[1]}"
        return None

    def to_a_part(call: ast.Call) -> bool:
        func = call.func
        return (isinstance(func, ast.Name) and func.id in classes) or (self_chain(func) is not None)

    found = []
    for node in ast.walk(tree):
        values: list[ast.expr] = []
        if isinstance(node, ast.Call) and to_a_part(node):
            values = [*node.args, *(k.value for k in node.keywords)]
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and self_chain(t) is None for t in node.targets
        ):
            values = [node.value]
        for value in values:
            if (why := offence(value)) is not None:
                found.append(f"line {node.lineno}: {why}")
    return sorted(found)


def test_the_callback_finder_finds_them() -> None:
    """Each form of a callback is found; data passed along is not."""
    source = """
class Root:
    def __init__(self):
        self.a = Part(lambda: 1, self.act, self.state)
        self.b = Part(self.a.work, self.a.count)
        def local(): ...
        other.hook = local
    def act(self): ...
class Part:
    def __init__(self, *args): self.count = 0
    def work(self): ...
"""
    tree = ast.parse(source)
    classes = {"Root": {"__init__", "act"}, "Part": {"__init__", "work"}}
    assert passed_callbacks(tree, classes) == [
        "line 4: a lambda",
        "line 4: the root's method self.act",
        "line 5: a part's method self.a.work",
        "line 7: local function local",
    ]


@pytest.mark.parametrize("root", ROOTS)
def test_no_callbacks_into_siblings(root: str) -> None:
    """No part is given a callback into a sibling or into its root (the old
    back-pointer in another form): parts return typed intents and the root routes them."""
    classes = part_classes(PART_PACKAGES)
    assert passed_callbacks(ast.parse((SRC / root).read_text()), classes) == []


def unit(path: Path) -> str:
    """A module's package (or the top-level module itself)."""
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def package_graph() -> dict[str, dict[str, set[str]]]:
    """Package -> package it imports -> the modules that import it."""
    edges: dict[str, dict[str, set[str]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        here = unit(path)
        for name in imports(path):
            parts = name.split(".")
            if parts[0] == "vertumnus" and len(parts) > 1 and parts[1] != here:
                target = parts[1]
                edges.setdefault(here, {}).setdefault(target, set()).add(str(path.relative_to(SRC)))
    return edges


def circles(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(edges) | {w for targets in edges.values() for w in targets}):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_between_packages() -> None:
    """The packages (and top-level modules) import one another in one direction only,
    function-level imports included."""
    edges = package_graph()
    report = [
        f"{a} -> {b} ({', '.join(sorted(edges[a][b]))})"
        for component in circles(edges)
        for a in component
        for b in component
        if b in edges.get(a, {})
    ]
    assert report == []


def test_circles_are_found() -> None:
    """The circle finder sees a circle of three and none in a chain."""
    ring = {"a": {"b": {"x"}}, "b": {"c": {"y"}}, "c": {"a": {"z"}}, "d": {"a": {"w"}}}
    assert circles(ring) == [["a", "b", "c"]]
    assert circles({"a": {"b": {"x"}}, "b": {"c": {"y"}}}) == []


def test_protocol_is_the_bottom() -> None:
    """The OpenAI dialect imports nothing above it: no torch, no HTTP server, no
    engine, decode or runtime."""
    above = ("torch", "aiohttp", "vertumnus.server", "vertumnus.decode", "vertumnus.runtime")
    above += ("vertumnus.engine", "vertumnus.sim", "vertumnus.cli", "vertumnus.policy")
    offences = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted((SRC / "protocol").rglob("*.py"))
        for name in sorted(imports(path))
        if any(name == f or name.startswith(f + ".") for f in above)
    ]
    assert offences == []


def test_policy_keeps_few_top_level_modules() -> None:
    """At most 12 modules at the top of ``policy/``; the rest live in its packages."""
    top = sorted(p.name for p in (SRC / "policy").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, top


# -- one word, one meaning (docs/architecture.md, "Words") -------------------------------

DOCS = SRC.parents[1] / "docs" / "architecture.md"


def glossary() -> dict[str, str]:
    """The "Words" table: word -> where it lives ("in the code")."""
    text = DOCS.read_text()
    table = text[text.index("## Words") : text.index("## Packages")]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    return {row[0].removeprefix("| "): row[2] for row in rows[2:]}


def defined_classes() -> dict[str, list[str]]:
    classes: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(str(path.relative_to(SRC)))
    return classes


def test_the_glossary_names_what_exists() -> None:
    """Every module and class the glossary names is in the tree."""
    words = glossary()
    assert {"pool", "ranks", "lease", "hold", "allocation", "host tier"} <= set(words)
    classes = defined_classes()
    missing = []
    for word, where in words.items():
        for name in re.findall(r"`([^`]+)`", where):
            if name.endswith(".py"):
                if not (SRC / name).is_file():
                    missing.append(f"{word}: {name}")
            elif name[:1].isupper() and name not in classes:
                missing.append(f"{word}: {name}")
    assert missing == []


def test_only_the_hand_off_lease_is_a_lease() -> None:
    """ "lease" names one thing: the runtime's grant of held blocks to one pull."""
    leases = {name: paths for name, paths in defined_classes().items() if "lease" in name.lower()}
    assert leases == {"Lease": ["runtime/kv/leases.py"]}


def test_no_ranks_is_called_pool() -> None:
    """A ``Ranks`` object is ``ranks``, never ``pool`` (the pool is the stack's)."""
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and node.annotation is not None:
                named_pool = node.arg in ("pool", "_pool")
                if named_pool and "Ranks" in ast.unparse(node.annotation):
                    offences.append(f"{path.relative_to(SRC)}:{node.lineno}")
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                made = ast.unparse(node.value.func)
                for target in node.targets:
                    name = target.attr if isinstance(target, ast.Attribute) else ""
                    name = target.id if isinstance(target, ast.Name) else name
                    if name in ("pool", "_pool") and made.endswith("Ranks"):
                        offences.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offences == []
