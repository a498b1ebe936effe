"""The import contract: the store and the kernels need nothing from above them, only the API imports FastAPI, and no
module imports, at any depth, one that imports it back (function-level imports included: they hide cycles)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"ragcache": "ragcache", "store": "ragcache.store", "kernels": "ragcache.kernels", "api": "ragcache.api"}
ENTRY_POINTS = {"ragcache.cli", "ragcache.store_cli", "ragcache.train.cli"}  # the commands: above every layer


@functools.cache
def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The product modules `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


@functools.cache  # the tests only read it
def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def third_party(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return {n.split(".")[0] for n in names}


def test_the_store_and_the_kernels_import_nothing_from_above_them():
    for name, targets in graph().items():
        for lower in ("ragcache.store", "ragcache.kernels"):
            if name == lower or name.startswith(lower + "."):
                above = {t for t in targets if not (t == lower or t.startswith(lower + "."))}
                assert not above, f"{name} imports {sorted(above)}"


def test_only_the_api_and_the_commands_import_the_api_and_fastapi():
    for name, path in modules().items():
        if name.startswith("ragcache.api") or name in ENTRY_POINTS:
            continue
        assert not {"fastapi", "starlette", "uvicorn"} & third_party(path), name
        assert not {t for t in graph()[name] if t.startswith("ragcache.api")}, name


def test_the_package_imports_nothing_from_the_checkout_around_it():
    # bench/, research/ and tests/ are not in the wheel, nor on an installed console script's path: an import of
    # them works only when Python runs from the repository root
    for name, path in modules().items():
        outside = {"bench", "research", "tests"} & third_party(path)
        assert not outside, f"{name} imports {sorted(outside)}"


def test_no_import_cycle():
    edges = {name: {t for t in targets if t not in ENTRY_POINTS} for name, targets in graph().items()}
    edges = {name: targets for name, targets in edges.items() if name not in ENTRY_POINTS}
    # a package's __init__ re-exporting its modules is not a cycle of concepts: judge modules, not packages
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    cycles = []
    for start in edges:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start and not packages & set(trail):
                    cycles.append(trail)
                elif nxt not in seen and nxt in edges:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
    assert not cycles, "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_only_the_algorithm_table_compares_algorithm_names():
    """What an algorithm reuses, reads and recomputes is asked of linker.TABLE; no other module decides by
    comparing a name (choosing one, `LinkParams("full")`, is fine)."""
    import re

    compared = re.compile(r"""algorithm\w*\)?\s*(==|!=|(not )?in)\s*[\({]?\s*["'](full|naive|cacheblend|legolink0?|focus|prefix)["']""")
    for name, path in modules().items():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            decides = compared.search(line) and not line.lstrip().startswith("for ")  # a loop over names chooses
            assert not decides, f"{path.relative_to(ROOT)}:{number}: {line.strip()}"


def _engine_imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, what) for each import of the engine's insides in `path`: a module inside ragcache/engine/, or a name
    its __init__ does not export."""
    import ragcache.engine as engine

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("ragcache.engine.")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            if base.startswith("ragcache.engine."):
                found.append((node.lineno, base))
            elif base == "ragcache.engine":
                found += [(node.lineno, f"ragcache.engine.{a.name}") for a in node.names if a.name not in engine.__all__]
            elif base == "ragcache":
                found += [(node.lineno, "ragcache.engine") for a in node.names if a.name == "engine"]
    return found


def test_the_engine_is_crossed_only_through_its_init():
    """ragcache/engine/ is one folder with one door: the product outside it and bench/ import what its __init__
    exports, never a module inside it (tests and research/ may look inside)."""
    import ragcache.engine as engine

    assert sorted(engine.__all__) == sorted(engine._HOMES) == engine.__all__
    for name in engine.__all__:
        assert getattr(engine, name) is not None
    crossings = []
    for name, path in modules().items():
        if name == "ragcache.engine" or name.startswith("ragcache.engine."):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        crossings += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in _engine_imports(path, package)]
    for path in sorted((ROOT / "bench").glob("*.py")):
        crossings += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in _engine_imports(path, "bench")]
    assert not crossings, "\n".join(crossings)
