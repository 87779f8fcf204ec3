"""Structural facts about the package, read from its source (no import of it runs).

The house has floors, top to bottom:
`cli → api/ → services/ → server → served_models → device_loop → worker (compute_requests, optim_steps,
tail_requests, request_failures, request_parts) → sampling/ → checkpoints/ → runtime/ → the ground
floor (config, store, scheduler, errors, vision, wire, …)`.
A module imports only from its own floor or below, and no two modules import each other, even
through others or from inside a function. The API and the services see requests and their
answers only through typed values, never a device-side module; HTTP stays in `api/`.

Each `KNOWN_*` set lists what still breaks a rule: a ratchet. A new break fails, and so does
a listed one that is gone (take it off the list), so the lists only shrink.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from functools import cache

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hosted_tinker"
TESTS = pathlib.Path(__file__).resolve().parent
GENERATED = {"hosted_tinker.wire.tinker_wire_pb2"}
MAX_LINES = 500
MAX_FUNCTION_LINES = 60  # a function a reader follows without scrolling

# Floors, from the top down; a module's floor is that of its longest listed prefix.
FLOORS = [
    ("hosted_tinker.__main__", "hosted_tinker.cli", "hosted_tinker.export"),
    ("hosted_tinker.api",),
    ("hosted_tinker.services",),
    ("hosted_tinker.server", "hosted_tinker.startup", "hosted_tinker.access", "hosted_tinker.accounting"),
    ("hosted_tinker.served_models",),
    ("hosted_tinker.device_loop",),
    ("hosted_tinker.worker", "hosted_tinker.compute_requests", "hosted_tinker.optim_steps",
     "hosted_tinker.tail_requests", "hosted_tinker.request_failures", "hosted_tinker.request_parts"),
    ("hosted_tinker.sampling",),
    ("hosted_tinker.checkpoints", "hosted_tinker.model_runtime"),
    ("hosted_tinker.runtime",),
    ("hosted_tinker",),  # the ground floor: everything not named above
]
# What the API and the services may not import: the modules that run on the device.
DEVICE_SIDE = ("hosted_tinker.worker", "hosted_tinker.compute_requests", "hosted_tinker.optim_steps",
               "hosted_tinker.tail_requests", "hosted_tinker.device_loop", "hosted_tinker.runtime.trainer",
               "hosted_tinker.runtime.distributed", "hosted_tinker.runtime.multi_lora",
               "hosted_tinker.runtime.moe_lora", "hosted_tinker.sampling.engine")

KNOWN_CIRCLES: set[frozenset[str]] = set()
KNOWN_ARROWS_UP: set[tuple[str, str]] = set()
KNOWN_DEVICE_IMPORTS: set[tuple[str, str]] = set()
KNOWN_HTTP_OUTSIDE_API: set[str] = set()
KNOWN_LONG_MODULES: set[str] = set()
KNOWN_STRING_DISPATCH: set[str] = set()
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()
KNOWN_SCHEME_LITERALS: set[str] = set()
KNOWN_LONG_FUNCTIONS: set[str] = set()
KNOWN_TEST_IMPORTS: set[tuple[str, str]] = set()
# Limits (settings named max_*) that bound by doing something else than refusing a request: each says what.
LIMITS_THAT_REFUSE_NOTHING = {
    "max_tokens_per_micro_batch": "a fused pass is cut into micro-batches of at most this many tokens",
    "max_live_adapters": "idle training runs beyond it are paged out to CPU memory, and back on their next request",
    "max_sampler_snapshots": "the least recently used sampler snapshots beyond it are let go, and read again on use",
}


def short(name: str) -> str:
    return name.removeprefix("hosted_tinker.")


@cache
def modules(generated: bool = False) -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if generated or name not in GENERATED:
            out[name] = path
    return out


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text())


def imported(name: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for each package module `node` imports."""
    mods = modules(generated=True)
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name in mods]
    if node.level:
        package = name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [node.module or ""]).strip(".")
    else:
        base = node.module or ""
    out = []
    for a in node.names:
        if f"{base}.{a.name}" in mods:
            out.append((f"{base}.{a.name}", None))
        elif base in mods:
            out.append((base, a.name))
    return out


@cache
def imports() -> dict[str, set[tuple[str, str | None]]]:
    """Every package import of every module, at its top or inside a function."""
    out = {}
    for name in modules():
        out[name] = {(m, n) for node in ast.walk(tree(name)) if isinstance(node, (ast.Import, ast.ImportFrom))
                     for m, n in imported(name, node) if m != name and m not in GENERATED}
    return out


def edges() -> dict[str, set[str]]:
    return {m: {t for t, _ in targets} for m, targets in imports().items()}


def floor(name: str) -> int:
    best = max((len(p), i) for i, prefixes in enumerate(FLOORS) for p in prefixes
               if name == p or name.startswith(p + "."))
    return best[1]


def circles() -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph, index, low, stack, on, found = edges(), {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(short(m) for m in component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def docstrings(module: ast.Module) -> set[int]:
    nodes = [module] + [n for n in ast.walk(module) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                      ast.ClassDef))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_no_import_circles():
    assert circles() == KNOWN_CIRCLES


def test_no_arrow_points_up_a_floor():
    up = {(short(m), short(t)) for m, ts in edges().items() for t in ts if floor(t) < floor(m)}
    assert up == KNOWN_ARROWS_UP


def test_api_and_services_import_no_device_side_module():
    found = {(short(m), short(t)) for m, ts in edges().items() for t in ts
             if short(m).split(".")[0] in ("api", "services") and t.startswith(DEVICE_SIDE)}
    assert found == KNOWN_DEVICE_IMPORTS


def test_http_stays_in_api():
    found = set()
    for name in modules():
        if short(name).startswith("api"):
            continue
        for node in ast.walk(tree(name)):
            roots = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(r.split(".")[0] in ("fastapi", "starlette", "sse_starlette") for r in roots):
                found.add(short(name))
    assert found == KNOWN_HTTP_OUTSIDE_API


def test_no_module_is_over_500_lines():
    long = {short(m) for m, p in modules().items() if len(p.read_text().splitlines()) > MAX_LINES}
    assert long == KNOWN_LONG_MODULES


def test_no_method_name_is_built_from_a_string():
    """A call of `getattr(obj, <a built string>)(...)`: dispatch on a string (the worker's
    `getattr(self, f"_{kind}")` was one). Reading a data attribute by a built name is fine."""
    found = {short(m) for m in modules() for node in ast.walk(tree(m))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Call)
             and isinstance(node.func.func, ast.Name) and node.func.func.id == "getattr"
             and len(node.func.args) >= 2 and isinstance(node.func.args[1], (ast.JoinedStr, ast.BinOp))}
    assert found == KNOWN_STRING_DISPATCH


def test_no_private_name_is_imported_from_another_module():
    found = {(short(m), n) for m, targets in imports().items() for _, n in targets
             if n is not None and n.startswith("_") and not n.startswith("__")}
    assert found == KNOWN_PRIVATE_IMPORTS


def test_tinker_paths_are_built_in_one_module():
    """Only checkpoints/paths.py spells the scheme: every other module builds and parses
    `tinker://` paths through it (prose that mentions one in a sentence is fine)."""
    found = set()
    for name in modules():
        skip = docstrings(tree(name))
        for node in ast.walk(tree(name)):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
                    and node.value.startswith("tinker://")):
                found.add(short(name))
    assert found - {"checkpoints.paths"} == KNOWN_SCHEME_LITERALS


def functions(node: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from functions(child, name + ".")


def test_no_function_is_over_60_lines():
    """Counted from its `def` to its last line, docstring included."""
    long = {f"{short(m)}.{name}" for m in modules() for name, node in functions(tree(m))
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert long == KNOWN_LONG_FUNCTIONS


def test_no_test_module_imports_another():
    """What test modules share lives in modules that are not tests (helpers.py, tiny_model.py, ...):
    importing a test module runs its module-level code and ties the two files together."""
    tests = {p.stem for p in TESTS.glob("test_*.py")}
    found = set()
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found |= {(path.stem, n) for n in names if n in tests}
    assert found == KNOWN_TEST_IMPORTS


def strings_of(name: str) -> str:
    """Every string literal of a module, f-strings' literal parts included, docstrings excluded."""
    skip = docstrings(tree(name))
    return "\n".join(node.value for node in ast.walk(tree(name))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip)


def test_every_limit_is_refused_by_name_and_tested():
    """Each `max_*` setting is either named by a refusal's message (so the user knows which setting
    refused them) and that name appears in a test, or is listed above with what it does instead."""
    config = tree("hosted_tinker.config")
    settings = {node.target.id for node in ast.walk(config)
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    renamed = {t.value for node in ast.walk(config) if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "RENAMED" for t in node.targets)
               for t in node.value.keys}  # old names, which set the new one
    limits = {s for s in settings if s.startswith("max_")} - set(LIMITS_THAT_REFUSE_NOTHING) - renamed
    messages = "\n".join(strings_of(m) for m in modules() if m not in ("hosted_tinker.config", "hosted_tinker.startup"))
    tests = "\n".join(p.read_text() for p in TESTS.glob("test_*.py") if p.name != pathlib.Path(__file__).name)
    assert sorted(s for s in limits if s not in messages) == [], "refusals that do not name their setting"
    assert sorted(s for s in limits if s not in tests) == [], "limits whose refusal no test shows"


def test_ruff_finds_nothing():
    """The linter, with pyproject.toml's [tool.ruff] settings, over every Python file of the project:
    the package, its tests, benchmarks and tools."""
    root = PACKAGE.parent
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "hosted_tinker", "tests", "benchmarks",
                          "tools"],
                         cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
