"""Soundness rule 7: the certificate package (writer, outcome types, checker) and diagnosis never reach the engine,
directly or through the modules they import — a fault in the engine cannot be repeated by the checker."""
import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "tv_ray"


def _module_path(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] != "tv_ray":
        return None
    base = ROOT.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _imports(path: Path) -> set[str]:
    """The tv_ray modules `path` imports (at any depth of its body: function-level imports count too)."""
    package = ".".join(("tv_ray",) + path.relative_to(ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        package = package.rsplit(".", 1)[0] + ".__init__"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:-node.level] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names if _module_path(f"{base}.{a.name}")}
    return {name for name in out if name.startswith("tv_ray")}


def reaches(start: Path) -> dict[str, list[str]]:
    """Every tv_ray module reachable by imports from `start`, with the chain that reaches it."""
    chains = {str(start.relative_to(ROOT)): [str(start.relative_to(ROOT))]}
    stack = [start]
    while stack:
        path = stack.pop()
        here = chains[str(path.relative_to(ROOT))]
        names = _imports(path)
        # importing a.b.c runs a/__init__ and a/b/__init__ too
        names |= {".".join(n.split(".")[:i]) for n in names for i in range(2, n.count(".") + 1)}
        for name in names:
            target = _module_path(name)
            if target is None or str(target.relative_to(ROOT)) in chains:
                continue
            chains[str(target.relative_to(ROOT))] = here + [name]
            stack.append(target)
    return chains


CHECKED = sorted((ROOT / "certificate").glob("*.py")) + [ROOT / "diagnose.py"]


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_certificate_and_diagnosis_never_reach_the_engine(path):
    engine = {m: chain for m, chain in reaches(path).items() if m.startswith("engine/")}
    assert not engine, f"{path.relative_to(ROOT)} reaches the engine: " + \
        "; ".join(" -> ".join(chain) for chain in engine.values())


def test_the_import_walk_sees_an_engine_import(tmp_path, monkeypatch):
    """The test above can fail: a module importing the engine through another is caught, naming the chain."""
    fake = tmp_path / "tv_ray"
    (fake / "engine").mkdir(parents=True)
    (fake / "certificate").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "engine" / "__init__.py").write_text("")
    (fake / "engine" / "driver.py").write_text("")
    (fake / "certificate" / "__init__.py").write_text("")
    (fake / "helper.py").write_text("def f():\n    from tv_ray.engine.driver import verify_plan\n")
    (fake / "certificate" / "check.py").write_text("from tv_ray import helper\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    chains = reaches(fake / "certificate" / "check.py")
    assert chains["engine/driver.py"] == ["certificate/check.py", "tv_ray.helper", "tv_ray.engine.driver"]
