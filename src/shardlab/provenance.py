"""Which source files a piece of work executes: a module and every shardlab module it imports, at module
level or inside functions, followed through the package. The workflow declares them as a job's inputs,
so that an edit to any of them, and only to them, reruns the job."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).parent


def module_path(module: str) -> Path | None:
    """'shardlab.strategies.composed' -> its file (a package's __init__.py), None outside the package."""
    parts = module.split(".")
    if parts[0] != "shardlab":
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _module_name(path: Path) -> str:
    name = ".".join(("shardlab", *path.relative_to(PACKAGE).with_suffix("").parts))
    return name.removesuffix(".__init__")


@functools.cache
def direct_imports(path: Path) -> frozenset[Path]:
    """The shardlab files `path` imports (a `from package import name` counts the submodule where there is one)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    return frozenset(_imported(ast.parse(path.read_text()), package) - {path})


def _imported(tree: ast.AST, package: str) -> set[Path]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {p for p in map(module_path, names) if p is not None}
    return found


def sources(module: str) -> list[Path]:
    """`module`'s file, the packages above it (their __init__ runs on import) and everything they import."""
    start = module_path(module)
    if start is None:
        raise ValueError(f"{module!r} is not a shardlab module")
    return _closure([start])


def page_sources(pages: list[Path]) -> list[Path]:
    """What a report's pages (Quarto .qmd) execute: every shardlab module their Python chunks import, and theirs."""
    chunks = [code for page in pages for code in re.findall(r"^```\{python\}\n(.*?)^```", Path(page).read_text(), re.S | re.M)]
    return _closure([p for code in chunks for p in _imported(ast.parse(code), "shardlab")])


def _closure(start: list[Path]) -> list[Path]:
    """The files `start` executes: each, the packages above it (their __init__ runs on import) and what they import."""
    parents = [PACKAGE.joinpath(*path.relative_to(PACKAGE).parts[:k], "__init__.py")
               for path in start for k in range(1, len(path.relative_to(PACKAGE).parts))]
    todo, seen = [*start, *(p for p in parents if p.is_file())], set()
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(direct_imports(path))
    return sorted(seen)
