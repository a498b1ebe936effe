"""The import contract: the store and the kernels need nothing from above them, only the API imports FastAPI, no
module imports, at any depth, one that imports it back (function-level imports included: they hide cycles), and
bench/ reaches an engine only through its public names."""

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

    assert sorted(engine.__all__) == sorted(engine._HOMES)  # (their order: ruff, RUF022)
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


ENGINE_PARTS = {"driver", "runner", "scheduler"}  # the model thread's parts a RagCache owns
ENGINE_CLASSES = {"RagCache", "VllmRagCache"}
ENGINE_HELPERS = {"engine", "_engine", "open_engine"}  # bench's and the server's functions that open one


def _opens_an_engine(node: ast.AST) -> bool:
    """Whether an expression makes an engine somewhere in it: RagCache(...), RagCache.open(...), engine(...)."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            fn = call.func
            if isinstance(fn, ast.Name) and fn.id in ENGINE_CLASSES | ENGINE_HELPERS:
                return True
            if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id in ENGINE_CLASSES:
                return True
    return False


def _engine_names(tree: ast.AST) -> set[str]:
    """The names a file holds engines in: `rc` (the bench's name for one, its functions' parameter too), and any
    name assigned an expression that opens one (an engine, or a dict of them)."""
    names = {"rc"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _opens_an_engine(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    return names


def _private_reaches(path: Path) -> list[tuple[int, str]]:
    """(line, what) for each reach past an engine's public face in `path`: its model-thread parts (`.driver`,
    `.runner`, `.scheduler`, on whatever holds them), a `_name` of an engine, a private module or name of ragcache
    imported (statically or by importlib.import_module)."""
    tree = ast.parse(path.read_text())
    engines = _engine_names(tree)

    def is_engine(node: ast.AST) -> bool:
        if isinstance(node, ast.Subscript):  # engines[label]
            node = node.value
        return isinstance(node, ast.Name) and node.id in engines

    def private(dotted: str) -> bool:
        return dotted.split(".")[0] == "ragcache" and any(
            p.startswith("_") and not p.startswith("__") for p in dotted.split(".")
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dunder = node.attr.startswith("__")
            if node.attr in ENGINE_PARTS or (node.attr.startswith("_") and not dunder and is_engine(node.value)):
                found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [(node.lineno, name) for name in names if private(name)]
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            module = str(node.args[0].value)
            if private(module) or module.startswith("ragcache.engine."):
                found.append((node.lineno, module))
    return sorted(set(found))


def test_bench_reaches_an_engine_only_through_its_public_names():
    """bench/ measures an engine as a user holds one: through RagCache's and Front's methods, EngineConfig's fields
    and ragcache.engine's exports (RagCache.step_stats, set_row_budgets, with_runner, close, ...), never its
    model-thread parts or private names, which change under it."""
    reaches = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        reaches += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in _private_reaches(path)]
    assert not reaches, "\n".join(reaches)


def test_the_bench_rule_sees_each_kind_of_reach(tmp_path):
    """The rule above flags what it is meant to, and not a local runner, a bench object's own `_name`, or another
    library's object's."""
    source = tmp_path / "probe.py"
    source.write_text(
        "import importlib\n"
        "from ragcache.engine import Runner\n"
        "from ragcache._hidden import thing\n"
        "from ragcache.store import _secret\n"
        "ENGINE = importlib.import_module('ragcache.engine.driver')\n"
        "def f(rc, lm, llm, self):\n"
        "    rc.driver.call(print)\n"
        "    fresh = RagCache.open('m')\n"
        "    fresh._ensure([])\n"
        "    engines = {c: engine(lm) for c in 'ab'}\n"
        "    engines['a']._compile([], 'default')\n"
        "    runner = Runner(lm)\n"
        "    runner.forward_rows(1)\n"
        "    llm._ctx.reset()\n"
        "    self._stop.set()\n"
        "    return rc.step_stats(), type(rc).__name__\n"
    )
    assert [what for _, what in _private_reaches(source)] == [
        "ragcache._hidden.thing",
        "ragcache.store._secret",
        "ragcache.engine.driver",
        "rc.driver",
        "fresh._ensure",
        "engines['a']._compile",
    ]


def test_the_commands_start_without_torch_dynamo_or_transformers():
    """`ragcache --help` and the store's commands load no model: importing torch's compiler (torch._dynamo, pulled in
    by torch.nn.attention.bias) or transformers at the CLI's import cost seconds before every command's first line."""
    import subprocess
    import sys

    heavy = ("torch._dynamo", "transformers", "fastapi", "vllm")
    done = subprocess.run(
        [sys.executable, "-c", f"import sys, ragcache.cli; print([m for m in {heavy!r} if m in sys.modules])"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
