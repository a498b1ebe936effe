"""mypy over the product packages under the names they are installed as (pyproject's [tool.setuptools] package-dir):
the folders `store`, `kernels` and `api` are ragcache.store, ragcache.kernels and ragcache.api, a mapping mypy cannot
make from paths. It runs from outside the checkout because mypy searches its working directory first, where the
top-level `kernels` folder would shadow Hugging Face's `kernels` package that transformers imports.

    python tools/typecheck.py    # the settings are pyproject's [tool.mypy]; exit status 1 on any error
"""

import os
import sys
import tempfile
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ragcache": "ragcache", "ragcache.store": "store", "ragcache.kernels": "kernels", "ragcache.api": "api"}


def sources() -> list[BuildSource]:
    out = []
    for package, folder in PACKAGES.items():
        base = ROOT / folder
        # os.walk leaves out linked folders: a checkout may link ragcache/store -> ../store for plain imports
        paths = [Path(d, f) for d, _, files in os.walk(base) for f in files if f.endswith(".py")]
        for path in sorted(paths):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append(BuildSource(str(path), ".".join((package, *parts))))
    return out


def main() -> int:
    _, options = process_options(
        ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "ragcache"]
    )
    options.show_absolute_path = True  # then made relative to the checkout, wherever mypy runs
    os.chdir(tempfile.gettempdir())
    try:
        result = build.build(sources(), options)
        messages = result.errors
    except CompileError as exc:
        messages = exc.messages
    for line in messages:
        print(line.replace(f"{ROOT}{os.sep}", ""))
    errors = sum(": error:" in line for line in messages)
    print(f"mypy: {errors} error(s) in {len(PACKAGES)} packages", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
