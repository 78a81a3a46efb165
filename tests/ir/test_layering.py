"""tv_ray.ir is the bottom of the flow: its modules import nothing of tv_ray but tv_ray.ir and tv_ray.errors."""
from __future__ import annotations

import ast
from pathlib import Path

import tv_ray.ir

ALLOWED = ("tv_ray.ir", "tv_ray.errors")


def imported(source: str, module: str) -> list[str]:
    """Every module `source` imports (relative imports resolved against `module`), at any depth of the file."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[:-node.level]
                base = ".".join(package + ([base] if base else []))
            names.append(base)
    return names


def outside(names: list[str]) -> list[str]:
    return [n for n in names if (n == "tv_ray" or n.startswith("tv_ray."))
            and not any(n == a or n.startswith(a + ".") for a in ALLOWED)]


def test_ir_imports_only_ir_and_errors():
    root = Path(tv_ray.ir.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 5          # the package is there to check: __init__, dims, graph, lint, ops
    bad = {f"{path.relative_to(root)}: {name}"
           for path in files
           for name in outside(imported(path.read_text(), "tv_ray.ir." + path.stem))}
    assert not bad, f"tv_ray.ir imports from a later stage: {sorted(bad)}"


def test_the_check_sees_a_forbidden_import():
    assert outside(imported("from tv_ray.semantics.table import rule_for\nimport tv_ray.errors\n", "tv_ray.ir.x")) \
        == ["tv_ray.semantics.table"]
    assert outside(imported("def f():\n    from ..semantics import RULES\n", "tv_ray.ir.lint")) == ["tv_ray.semantics"]
    assert outside(imported("import tv_ray\n", "tv_ray.ir.x")) == ["tv_ray"]
    assert outside(imported("from . import graph\nfrom tv_ray.ir.ops import Op\n", "tv_ray.ir.x")) == []
