"""The verification commands: `tv-ray verify`, `tv-ray check`, `tv-ray explain`.

    tv-ray verify --model llama3-tiny --parallel dp=2,tp=2,pp=2,mb=2 --optim adamw --clip 1.0 -o out
    tv-ray verify plan.json -o out --address 10.0.0.1:6379      # solver actors on a running Ray cluster
    tv-ray verify --resume out                                  # continue a killed run from out/checkpoint
    tv-ray check out
    tv-ray explain out

`verify` exits 0 when the plan is proved (out/certificate.json written), 1
when it is refuted (out/report.json names the first wrong tensor), 2 when it
is not proved or on an error (saying what). Solving runs on Ray by default (a
local Ray on every core, or the cluster at --address / RAY_ADDRESS); every
verdict streams to out/checkpoint as it arrives.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tv_ray.engine.executor import ENGINES
from tv_ray.errors import CertificateError, TvRayError
from tv_ray.models import list_models

EXIT = {"proved": 0, "refuted": 1, "unknown": 2}


def _one_line(err: Exception) -> str:
    return " | ".join(str(err).splitlines())


def cmd_verify(args: argparse.Namespace) -> int:
    from tv_ray.api import verify
    from tv_ray.diagnose import explain
    if args.resume is not None:
        if args.plan is not None or args.model is not None:
            print("tv-ray verify: --resume OUT continues the run recorded in OUT; give no plan or --model",
                  file=sys.stderr)
            return 2
        args.output = args.output or args.resume
    elif (args.plan is None) == (args.model is None):
        print("tv-ray verify: give a plan file or --model NAME --parallel SPEC (not both)", file=sys.stderr)
        return 2
    elif args.output is None:
        print("tv-ray verify: -o OUT is required (where the certificate or report goes)", file=sys.stderr)
        return 2
    if args.model is not None and args.parallel is None:
        print("tv-ray verify: --model needs --parallel SPEC, e.g. --parallel dp=2,tp=2", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        result = verify(args.plan or args.model, args.parallel, optim=args.optim, clip=args.clip, sp=args.sp,
                        zero=args.zero, solvers=tuple(args.solvers.split(",")), timeout=args.timeout,
                        jobs=args.jobs, progress=False if args.quiet else None, seed=args.seed,
                        symmetry=not args.no_symmetry, engine=args.engine, address=args.address,
                        checkpoint=args.output, resume=args.resume is not None,
                        shards={"auto": None, "on": True, "off": False}[args.shards])
        written = result.save(args.output)
    except (TvRayError, OSError, ValueError) as err:
        print(f"tv-ray verify: {_one_line(err)}", file=sys.stderr)
        if (Path(args.output) / "checkpoint" / "run.json").exists():
            print(f"tv-ray verify: the verdicts so far are in {args.output}/checkpoint; continue with "
                  f"`tv-ray verify --resume {args.output}`", file=sys.stderr)
        return 2
    outcome = result.outcome
    if not args.quiet:
        print(explain(result.report))
        print(f"  {'phase':<10} {'seconds':>9}")
        for phase, seconds in outcome.phases.items():
            print(f"  {phase:<10} {seconds:>9.2f}")
        print(f"  {'total':<10} {time.perf_counter() - started:>9.2f}   solved on {outcome.executor}")
        print(f"  unique keys by tier: {json.dumps(outcome.tiers())}")
        if outcome.resumed:
            print(f"  resumed: {outcome.resumed} unique keys' verdicts taken from {args.output}/checkpoint")
        print(f"  wrote {written}")
    return EXIT[result.status]


def cmd_check(args: argparse.Namespace) -> int:
    from tv_ray.certificate import check_certificate
    try:
        report = check_certificate(args.out, sample=args.sample, solvers=tuple(args.solvers.split(",")),
                                   timeout_s=args.timeout)
    except CertificateError as err:
        print(f"tv-ray check: FAILED: {_one_line(err)}", file=sys.stderr)
        return 1
    except (TvRayError, OSError) as err:
        print(f"tv-ray check: {_one_line(err)}", file=sys.stderr)
        return 2
    print(f"tv-ray check: OK — {report.obligations} obligations, {report.unique} unique keys; re-proved "
          f"{report.resolved} ({report.different_method} by a different method, {report.same_method} only by "
          f"the recorded one; {json.dumps(report.methods)}) in {report.seconds:.2f}s")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from tv_ray.diagnose import explain
    out = Path(args.out)
    if (out / "report.json").exists():
        print(explain(json.loads((out / "report.json").read_text())))
        return 0
    if (out / "certificate.json").exists():
        m = json.loads((out / "certificate.json").read_text())
        c = m["counts"]
        print(f"tv-ray: PROVED — {m['plan']['model']} on {m['plan']['ranks']} ranks (mesh {m['plan']['mesh']}, "
              f"{m['plan']['microbatches']} microbatches): {c['obligations']} obligations, {c['unique']} unique "
              f"keys, by tier {m['tiers']}; reduced dims {m['reduction']['reduced']}; axioms {m['axioms']}")
        return 0
    print(f"tv-ray explain: {out} has neither report.json nor certificate.json", file=sys.stderr)
    return 2


def add_parsers(sub: argparse._SubParsersAction) -> None:
    verify = sub.add_parser("verify", help="prove a plan equals the single-device step, or locate the bug",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("plan", nargs="?", help="a plan file (tv-ray-plan/1)")
    verify.add_argument("--model", choices=list_models(), metavar="NAME", help="build the plan from a model")
    verify.add_argument("--parallel", metavar="SPEC", help="degrees, e.g. dp=2,tp=2,pp=2,mb=2")
    verify.add_argument("--sp", action="store_true", help="sequence parallel (with --model)")
    verify.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (with --model)")
    verify.add_argument("--optim", choices=("sgd", "adamw"), default="adamw", help="optimizer (with --model)")
    verify.add_argument("--clip", type=float, default=1.0, metavar="NORM", help="global-norm clip (with --model)")
    verify.add_argument("-o", "--output", metavar="OUT", help="directory for the certificate/report and checkpoint")
    verify.add_argument("--solvers", default="z3,cvc5,yices", help="tier 2 portfolio (default z3,cvc5,yices)")
    verify.add_argument("--timeout", type=float, default=10.0, metavar="S", help="per-equation solver timeout")
    verify.add_argument("--engine", choices=ENGINES, default="ray",
                        help="ray: solver actors on Ray (default); local: this process or --jobs processes")
    verify.add_argument("--address", metavar="HOST:PORT", default=None,
                        help="join a running Ray cluster (default: RAY_ADDRESS, else a local Ray)")
    verify.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="solver actors (ray; default every core but one) or processes (local; default 1)")
    verify.add_argument("--resume", metavar="OUT", default=None,
                        help="continue the run whose checkpoint is in OUT (solves only what is missing)")
    verify.add_argument("--no-symmetry", action="store_true",
                        help="run every dp rank in full instead of mirroring the ones the symmetry check allows")
    verify.add_argument("--shards", choices=("auto", "on", "off"), default="auto",
                        help="generate the stages one pipeline stage per shard, in parallel (auto: for plans of "
                             "a million ops or more)")
    verify.add_argument("--seed", type=int, default=0, help="seed of the concrete runs and random points")
    verify.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    verify.set_defaults(func=cmd_verify)
    check = sub.add_parser("check", help="re-validate a certificate independently")
    check.add_argument("out", metavar="OUT", help="the directory `tv-ray verify -o` wrote")
    check.add_argument("--sample", type=int, default=None, metavar="N", help="re-solve N unique keys (default all)")
    check.add_argument("--solvers", default="z3,yices", help="solvers for re-proving (default z3,yices)")
    check.add_argument("--timeout", type=float, default=10.0, metavar="S")
    check.set_defaults(func=cmd_check)
    explain = sub.add_parser("explain", help="print a verification report for a person")
    explain.add_argument("out", metavar="OUT")
    explain.set_defaults(func=cmd_explain)


__all__ = ["add_parsers", "cmd_verify", "cmd_check", "cmd_explain", "EXIT"]
