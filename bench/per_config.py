"""One benchmark config per child process (peak memory is then per config), its row merged into a results file.

    sys.exit(run_configs(__file__, "dp=512;dp=16,tp=8,pp=4,mb=32", ["--batch", "512"], "out.json",
                         good=lambda row: row["status"] == "proved"))

The child is the script itself with `--one --configs SPEC` and the extra arguments; its last stdout line is
the row (JSON). Rows already in the file for the same parallel spec are replaced (other runs may have written
others); exit status 0 when every child succeeded and `good` holds for its row.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable


def run_configs(script: str, configs: str, extra: list[str], out: str | Path, good: Callable[[dict], bool]) -> int:
    out = Path(out)
    ok = True
    for spec in configs.split(";"):
        child = subprocess.run([sys.executable, script, "--one", "--configs", spec, *extra], capture_output=True,
                               text=True)
        if child.returncode:
            print(child.stderr[-2000:], file=sys.stderr)
            ok = False
            continue
        row = json.loads(child.stdout.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        rows = json.loads(out.read_text())["rows"] if out.exists() else []
        rows = [r for r in rows if (r["parallel"], r.get("model")) != (spec, row.get("model"))] + [row]
        out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        ok = ok and good(row)
    return 0 if ok else 1
