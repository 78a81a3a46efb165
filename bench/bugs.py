"""Every bug class of docs/bugs.md through the verifier: the faulty plan refuted and located, its twin proved.

    python bench/bugs.py [--classes A1,B2,..] [--out bench/results/bugs.json] [--readme README.md]

For each class of the corpus (tests/engine/bugs.py: a mutation of a planner's plan, or a framework's own code traced
with the bug switched on) the faulty plan is verified on the local engine: refuted or not, the seconds to the report
(verification alone; building the plan is `build_s`), located (the first refuted stage where the fault enters and a
headline that says what it is: `Case.location_problems`), the factor or cause the headline names, whether the
concrete runs showed wrong outputs, and the twin's verdict. A class tv_ray cannot express is a row saying what it
lacks. Rows go to `--out` after every class — with `--classes`, in place of those classes' rows already there —
and the table between the README's "bug classes" markers is rewritten from them (`--readme ''` leaves the README
alone). Exit 1 if an expressible class is not refuted and located or a twin is not proved.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engine.bugs import CORPUS, DOCS  # noqa: E402
from tv_ray import api  # noqa: E402

BEGIN, END = "<!-- bug classes: written by bench/bugs.py -->", "<!-- end of bug classes -->"


def titles() -> dict[str, str]:
    return dict(re.findall(r"^\| ([ABC]\d+) \| (.+?) \|", DOCS.read_text(), re.M))


def run(cls: str, title: str) -> dict:
    bug = CORPUS[cls]
    row = {"id": cls, "title": title, "expressible": bug.expressible, "how": bug.how or bug.missing}
    if not bug.expressible:
        return row
    start = time.perf_counter()
    case = bug.build()
    built = time.perf_counter()
    result = api.verify(case.faulty, engine="local", progress=False, timeout=case.timeout)
    verified = time.perf_counter()
    problems = case.location_problems(result) if result.status == "refuted" else [f"status {result.status}"]
    headline = result.report.get("headline", "")
    stage = result.report.get("stage", {})
    twin = api.verify(case.twin, engine="local", progress=False, timeout=case.timeout)
    row.update(refuted=result.status == "refuted", seconds=round(verified - built, 2),
               build_s=round(built - start, 2), located=not problems, problems=problems,
               stage={key: stage.get(key) for key in ("ranks", "microbatch", "tensor", "module", "phase")},
               hint=headline.split(" — ", 1)[1] if " — " in headline else "",
               outputs_wrong=result.report.get("outputs_wrong_count", 0), headline=headline,
               twin=twin.status, twin_s=round(time.perf_counter() - verified, 2))
    return row


def table(rows: list[dict]) -> str:
    lines = ["| id | class | how built | refuted | s | located: first wrong tensor (rank, phase) — what the report "
             "says | twin |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if not row["expressible"]:
            lines.append(f"| {row['id']} | {row['title']} | not expressible: {row['how']} | — | — | — | — |")
            continue
        stage = row["stage"]
        where = (f"`{stage['tensor']}` (rank{'s' if len(stage['ranks'] or []) > 1 else ''} "
                 f"{', '.join(map(str, stage['ranks'] or []))}, {stage['phase'] or 'step'})")
        said = f" — {row['hint']}" if row["hint"] else ""
        located = ("yes: " if row["located"] else "NO: ") + where + said.replace("|", "\\|")
        lines.append(f"| {row['id']} | {row['title']} | {row['how']} | {'yes' if row['refuted'] else 'NO'} | "
                     f"{row['seconds']:.1f} | {located} | {row['twin']} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    done = [r for r in rows if r["expressible"]]
    return {"classes": len(rows), "expressible": len(done), "refuted": sum(r["refuted"] for r in done),
            "located": sum(r["located"] for r in done), "twins_proved": sum(r["twin"] == "proved" for r in done),
            "median_s": statistics.median(r["seconds"] for r in done) if done else None,
            "max_s": max((r["seconds"] for r in done), default=None),
            "not_expressible": [r["id"] for r in rows if not r["expressible"]]}


def write_readme(path: Path, rows: list[dict], total: dict) -> None:
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    said = (f"{total['expressible']} of {total['classes']} classes expressible; {total['refuted']} refuted, "
            f"{total['located']} located at the cause, {total['twins_proved']} twins proved; median "
            f"{total['median_s']:.1f} s to the report, slowest {total['max_s']:.1f} s (`python bench/bugs.py`, "
            f"{time.strftime('%Y-%m-%d')}).")
    path.write_text(f"{head}{BEGIN}\n{said}\n\n{table(rows)}\n{END}{tail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", default="", help="comma-separated ids (default: every class)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bugs.json"))
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    args = parser.parse_args(argv)
    names = titles()
    chosen = args.classes.split(",") if args.classes else list(CORPUS)
    out = Path(args.out)
    kept = {r["id"]: r for r in json.loads(out.read_text())["rows"]} if args.classes and out.exists() else {}
    for cls in chosen:
        kept[cls] = run(cls, names[cls])
        print(json.dumps({k: v for k, v in kept[cls].items() if k not in ("headline", "problems")}), flush=True)
        rows = [kept[c] for c in CORPUS if c in kept]
        total = summary(rows)
        out.write_text(json.dumps({"summary": total, "rows": rows}, indent=1) + "\n")
    if args.readme and len(rows) == len(CORPUS):
        write_readme(Path(args.readme), rows, total)
    print(json.dumps(total))
    bad = [r["id"] for r in rows if r["expressible"] and not (r["refuted"] and r["located"] and r["twin"] == "proved")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
