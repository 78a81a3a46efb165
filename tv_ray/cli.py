"""The `tv-ray` command: list models, build plans, simulate plans, verify them, check certificates.

Examples::

    tv-ray models
    tv-ray plan --model llama3-tiny --parallel dp=2,tp=2,pp=2,mb=2 --sp --optim adamw --clip 1.0 -o plan.json
    tv-ray trace docs/examples/dtensor_mlp.py --world-size 2 -o plan.json
    tv-ray run plan.json --seed 0
    tv-ray verify plan.json -o out --jobs 2
    tv-ray check out
    tv-ray explain out
"""
from __future__ import annotations

import argparse
import atexit
import errno
import gc
import json
import os
import sys
import time
from pathlib import Path

from tv_ray.errors import TvRayError
from tv_ray.processes import ends_unfreed, held_to_exit
from tv_ray.models import cmd_models
from tv_ray.commands import INTERRUPTED, add_model_flags, add_parsers
from tv_ray.simulate import add_run_parser, parse_dims


def _checked_save(plan, output: Path) -> None:
    """Write the plan while it is validated beside (`checked_beside`); a plan that fails is not left written."""
    from tv_ray.errors import PlanError
    from tv_ray.plan_check import checked_beside
    try:
        with checked_beside(plan):
            plan.save(output)
    except PlanError:
        output.unlink(missing_ok=True)
        raise


def _unwritable(command: str, output: Path) -> bool:
    """Say why a plan cannot be written to `output` (refused before the work, not after); False: it can."""
    if output.is_dir():
        print(f"tv-ray {command}: -o {output} is a directory; give the plan file's path, e.g. {output / 'plan.json'}",
              file=sys.stderr)
        return True
    above = next(p for p in output.absolute().parents if p.exists())
    if not above.is_dir():
        print(f"tv-ray {command}: cannot write {output}: {os.strerror(errno.ENOTDIR)} ({above})", file=sys.stderr)
        return True
    return False


def _written(command: str, output: Path, make, one_line: bool = True):
    """The plan `make()` builds, written to `output` as it is validated beside; None once the error was said."""
    try:
        plan = make()
        output.parent.mkdir(parents=True, exist_ok=True)
        _checked_save(plan, output)
    except TvRayError as err:
        print(f"tv-ray {command}: {' | '.join(str(err).splitlines()) if one_line else err}", file=sys.stderr)
        return None
    except OSError as err:
        print(f"tv-ray {command}: cannot write {output}: {err.strerror or err}", file=sys.stderr)
        return None
    return plan


def cmd_plan(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if _unwritable("plan", output):
        return 2
    from tv_ray.api import capture_step, parallelize
    start = time.perf_counter()
    dims, captured = {}, [start]

    def make():
        dims.update(parse_dims(args.dims))
        graph = capture_step(args.model, optim=args.optim, clip=args.clip, tied=args.tied, dims=dims or None,
                             masked=args.masked)
        captured[0] = time.perf_counter()
        return parallelize(graph, args.parallel, model=args.model, dims=dims or None, sp=args.sp, zero=args.zero,
                           recipe={"optim": args.optim, "clip": args.clip, "tied": args.tied,
                                   "masked": args.masked}, check=False)
    plan = _written("plan", output, make)
    if plan is None:
        return 2
    done = time.perf_counter()
    print(json.dumps({"plan": args.output, "model": args.model, "parallel": args.parallel, "sp": args.sp,
                      "zero": args.zero, "optim": args.optim, "clip": args.clip, "tied": args.tied,
                      "masked": args.masked, "dims": dims, "ranks": plan.num_ranks,
                      "programs": {name: len(p.nodes) for name, p in plan.programs.items()},
                      "logical_ops": len(plan.logical.nodes),
                      "seconds": {"capture": round(captured[0] - start, 2),
                                  "parallelize": round(done - captured[0], 2)}}))
    held_to_exit(plan)
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if _unwritable("trace", output):
        return 2
    from tv_ray.frontend.traced import trace
    start = time.perf_counter()
    try:
        plan = _written("trace", output, lambda: trace(args.script, args.world_size), one_line=False)  # a traceback
    except KeyboardInterrupt:       # the ranks have ended with their launcher (`trace`)
        print("tv-ray trace: interrupted", file=sys.stderr)
        return INTERRUPTED
    if plan is None:
        return 2
    loss = next(e for e in plan.lineage if e.tensor == "loss")     # as found by value: each rank's mean, summed
    print(json.dumps({"plan": args.output, "script": args.script, "mesh": dict(plan.mesh), "ranks": plan.num_ranks,
                      "programs": {name: len(p.nodes) for name, p in plan.programs.items()},
                      "loss": {"partial": list(loss.partial), "scale": str(loss.scale)},
                      "logical_ops": len(plan.logical.nodes), "seconds": round(time.perf_counter() - start, 2)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tv-ray", description="Verify distributed LLM training plans.")
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="list the built-in models and their shapes")
    models.set_defaults(func=cmd_models)
    plan = sub.add_parser("plan", help="capture a built-in model's training step and parallelize it into a plan",
                          description="Example: tv-ray plan --model llama3-tiny --parallel dp=2,tp=2,pp=2,mb=2 "
                                      "--sp --zero 1 --optim adamw --clip 1.0 -o plan.json")
    add_model_flags(plan, required=True)
    plan.add_argument("-o", "--output", required=True, help="where to write the plan JSON")
    plan.set_defaults(func=cmd_plan)
    trace = sub.add_parser("trace", help="run a torch.distributed training script on every rank and record its plan",
                           description="Example: tv-ray trace docs/examples/dtensor_mlp.py --world-size 2 -o plan.json "
                                       "(the script's contract: tv_ray.frontend.traced)")
    trace.add_argument("script", help="the training script (MESH, model, parallelize, optimizer, batch, loss)")
    trace.add_argument("--world-size", type=int, default=None, help="the number of ranks (default: MESH's)")
    trace.add_argument("-o", "--output", required=True, help="where to write the plan JSON")
    trace.set_defaults(func=cmd_trace)
    add_run_parser(sub)
    add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader went away (`tv-ray explain OUT | head`): what it read is all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def entry() -> None:
    """The `tv-ray` command: `main` in a process that ends with it, the cyclic collector off throughout. The work
    pauses it anyway (`gc_paused`); turned back on, its first pass would walk every object made meanwhile — at
    llama3-70b a verification's tens of millions, 3.6 s — only for the process to end. It ends once the exit
    handlers have run (`atexit`: Ray's, multiprocessing's, temporary directories'), without the interpreter's own
    teardown, which would free every object still held one by one (0.8 s after a 70B verification's last line) —
    and what the command made is held to that end (`held_to_exit`)."""
    gc.disable()
    ends_unfreed()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # a closed pipe (`tv-ray ... | head`): nothing more to say
            pass
    atexit._run_exitfuncs()
    os._exit(code or 0)


if __name__ == "__main__":
    entry()
