"""Structural facts about the package, read from its source (no import of it runs).

The floors of the house -- imports point down, never up; no two modules or packages import each
other; HTTP stays in `api/`; the API and the services see the device only through typed values;
the scheduler plans without the device; the two samplers know nothing of each other -- are
import-linter contracts in pyproject.toml (`[tool.importlinter]`), which `lint-imports` checks
here. What the tool cannot say is checked by hand below: module and function length, private
names, dispatch on strings, `tinker://` paths built in one module, limits that name themselves,
test modules that import each other.

Each `KNOWN_*` set lists what still breaks a rule: a ratchet. A new break fails, and so does
a listed one that is gone (take it off the list), so the lists only shrink.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys
from functools import cache

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hosted_tinker"
TESTS = pathlib.Path(__file__).resolve().parent
GENERATED = {"hosted_tinker.wire.tinker_wire_pb2"}
MAX_LINES = 500
MAX_FUNCTION_LINES = 60  # a function a reader follows without scrolling

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


def docstrings(module: ast.Module) -> set[int]:
    nodes = [module] + [n for n in ast.walk(module) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                      ast.ClassDef))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the package under `root`, with `root`'s pyproject.toml contracts."""
    command = pathlib.Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(command), "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_the_import_contracts_hold():
    """Every `[tool.importlinter]` contract of pyproject.toml is kept (the floors, no cycles, HTTP at
    the edge, typed values between the services and the device, the planner and the samplers apart)."""
    run = lint_imports(PACKAGE.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "broken" in run.stdout and " 0 broken" in run.stdout, run.stdout


@pytest.mark.parametrize("module, line, contract", [
    # the store, near the ground, reaching up to the HTTP edge
    ("store/records.py", "from ..api import app  # noqa: F401", "Imports point down the floors, never up"),
    # the runtime speaking HTTP itself
    ("runtime/packing.py", "import fastapi  # noqa: F401", "HTTP stays at the edge"),
    # the scheduler reaching for the worker it plans for
    ("training/fair_share.py", "from . import worker  # noqa: F401", "The scheduler plans without the device"),
])
def test_a_contract_breaks_when_an_import_breaks_it(tmp_path, module, line, contract):
    """The contracts are not vacuous: in a copy of the package, one import that breaks a rule makes
    `lint-imports` fail, naming that contract and the import."""
    shutil.copytree(PACKAGE, tmp_path / "hosted_tinker", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PACKAGE.parent / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "hosted_tinker" / module
    target.write_text(target.read_text() + "\n" + line + "\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0, run.stdout
    broken = run.stdout.split("Broken contracts")[-1]
    importer = "hosted_tinker." + module.removesuffix(".py").replace("/", ".")
    assert contract in broken and importer in broken, run.stdout


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
    config = tree("hosted_tinker.config.settings")
    settings = {node.target.id for node in ast.walk(config)
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    renamed = {t.value for node in ast.walk(config) if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "RENAMED" for t in node.targets)
               for t in node.value.keys}  # old names, which set the new one
    limits = {s for s in settings if s.startswith("max_")} - set(LIMITS_THAT_REFUSE_NOTHING) - renamed
    messages = "\n".join(strings_of(m) for m in modules() if m not in ("hosted_tinker.config.settings", "hosted_tinker.server.startup"))
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
