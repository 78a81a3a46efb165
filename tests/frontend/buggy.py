"""The test scripts of tests/frontend/scripts with a bug switched on: each script has a module-level BUG that a
name switches to a framework's faulty behaviour (its docstring lists them)."""
from __future__ import annotations

from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"


def with_bug(directory: Path, script: str, bug: str) -> Path:
    """The test script `script` with its BUG set: a script in `directory` that imports it, sets BUG and takes its
    contract."""
    path = Path(directory) / f"{script}_{bug}.py"
    path.write_text(f"import sys\nsys.path.insert(0, {str(SCRIPTS)!r})\nimport {script}\n"
                    f"from {script} import *  # noqa\n{script}.BUG = {bug!r}\n")
    return path
