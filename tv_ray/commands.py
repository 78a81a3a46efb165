"""The verification commands: `tv-ray verify`, `tv-ray check`, `tv-ray explain`.

    tv-ray verify --model llama3-tiny --parallel dp=2,tp=2,pp=2,mb=2 --optim adamw --clip 1.0 -o out
    tv-ray verify --model llama3-405b --parallel dp=64,tp=8,pp=16,mb=16 --dims batch=2048 -o out
    tv-ray verify --model deepseek-tiny --parallel dp=4,ep=2,tp=2,mb=2 -o out      # experts over ep
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
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from tv_ray.engine.executor import ENGINES
from tv_ray.errors import CertificateError, TvRayError
from tv_ray.models import list_models
from tv_ray.processes import held_to_exit
from tv_ray.simulate import parse_dims

EXIT = {"proved": 0, "refuted": 1, "unknown": 2}
INTERRUPTED = 130         # Ctrl-C: 128 + SIGINT, as shells report it — never "refuted"
STOP_S = 60.0             # how long a Ctrl-C waits for Ray to stop before killing its processes
STUCK_S = 30.0            # how long a Ctrl-C waits for the main thread to see it (`Interrupts`)


def _one_line(err: Exception) -> str:
    return " | ".join(str(err).splitlines())


class _Noted(argparse.Action):
    """Stores the value (after argparse's `type` and `choices`) and notes the option as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.model_flags = tuple(dict.fromkeys((*getattr(namespace, "model_flags", ()), option_string)))


class _NotedConst(_Noted):
    """A switch (like store_true / store_false): stores `const`, noted as given."""

    def __init__(self, option_strings, dest, const=None, default=None, required=False, help=None):
        super().__init__(option_strings, dest, nargs=0, const=const, default=default, required=required, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, self.const, option_string)


def solver_list(text: str) -> tuple[str, ...]:
    """--solvers: a comma-separated list of known solvers (argparse type)."""
    from tv_ray.smt.solvers import BACKENDS
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{'unknown solver ' + ', '.join(map(repr, unknown)) if unknown else 'none'}"
                                         f"; choose from {','.join(BACKENDS)}")
    return names


def seconds(text: str) -> float:
    """--timeout: a positive number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text}: a timeout must be a positive number of seconds")
    return value


def processes(text: str) -> int:
    """--jobs of `tv-ray check`: a positive number of processes (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least one process")
    return value


def add_model_flags(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """The model and its training recipe, defined once for `tv-ray plan` and `tv-ray verify --model`, with the
    same defaults (`tv_ray.frontend.optim.RECIPE`): --model, --parallel, --sp, --zero, --tied/--untied,
    --optim, --clip, --dims. `required` makes --model and --parallel required. Each of these options given on
    the command line is noted, in order, in ``args.model_flags`` (so a command can refuse the ones it would
    ignore)."""
    from tv_ray.frontend.optim import RECIPE
    optim, clip = RECIPE["optim"], RECIPE["clip"]
    parser.set_defaults(model_flags=())
    parser.add_argument("--model", required=required, choices=list_models(), metavar="NAME", action=_Noted,
                        help="a built-in model (see `tv-ray models`)")
    parser.add_argument("--parallel", required=required, metavar="SPEC", action=_Noted,
                        help="degrees, e.g. dp=2,tp=2,pp=2,mb=2 (mb: microbatches; ep: expert parallel, "
                             "carved out of dp, for a MoE model: dp=4,ep=2)")
    parser.add_argument("--sp", action=_NotedConst, const=True, default=False,
                        help="sequence parallel, needs tp > 1 (default: off)")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), action=_Noted,
                        help="ZeRO stage (default: %(default)s)")
    tied = parser.add_mutually_exclusive_group()
    tied.add_argument("--tied", dest="tied", action=_NotedConst, const=True, default=None,
                      help="tie the embedding and the output head (default: as the model is defined)")
    tied.add_argument("--untied", dest="tied", action=_NotedConst, const=False,
                      help="separate embedding and output head")
    parser.add_argument("--masked-targets", dest="masked", action=_NotedConst, const=True, default=False,
                        help="targets may also be the loss's ignore_index (-100: padding), and the proofs cover "
                             "them (default: targets are token ids)")
    parser.add_argument("--optim", choices=("sgd", "adamw"), default=optim, action=_Noted,
                        help="optimizer step (default: %(default)s)")
    parser.add_argument("--clip", type=float, default=clip, metavar="NORM", action=_Noted,
                        help="clip by global gradient norm (default: "
                             f"{'no clipping' if clip is None else '%(default)s'})")
    parser.add_argument("--dims", default="", metavar="NAME=SIZE,...", action=_Noted,
                        help="override model dims, e.g. batch=2048,seq=4096 (default: the model's own)")


class Interrupts:
    """Ctrl-C raises KeyboardInterrupt, as Python's own handler does, and is remembered: Python drops an
    exception raised inside a weakref callback or `__del__` (the term table's are hot: `tv_ray.terms.term`),
    so a Ctrl-C landing there would be lost and the run go on to its end; `check` raises it again. Python would
    also print the dropped one with its traceback ("Exception ignored in ..."): that one is kept quiet.

    Python runs the handler only when the main thread is back in Python. Ray's driver start can sit in native
    code that never returns — connecting to a local GCS that a Ctrl-C caught half started (seen in CI: still
    waiting nine minutes on): so the signal also wakes a watcher (`signal.set_wakeup_fd`), and where the main
    thread has not seen it within `grace_s`, the watcher ends the command as the handler's path would — `tv-ray
    NAME: interrupted`, `hint` (where the run can resume), every process below this one killed (the Ray it was
    starting) — and exits with 130 at once."""

    def __init__(self, name: str = "", hint=None, grace_s: float = STUCK_S):
        self.name, self.hint, self.grace_s = name, hint, grace_s

    def __enter__(self) -> "Interrupts":
        self.seen, self.previous, self.hook = False, None, sys.unraisablehook
        self._wakeup = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._interrupted)
            sys.unraisablehook = self._dropped
            woken, self._wakeup = socket.socketpair()
            self._wakeup.setblocking(False)
            self._earlier = signal.set_wakeup_fd(self._wakeup.fileno(), warn_on_full_buffer=False)
            _forgotten_in_forks()
            threading.Thread(target=self._watch, args=(woken,), name="ctrl-c", daemon=True).start()
        return self

    def _interrupted(self, signum, frame):
        self.seen = True
        raise KeyboardInterrupt

    def _dropped(self, unraisable) -> None:
        if not (self.seen and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self.hook(unraisable)

    def _watch(self, woken: socket.socket) -> None:
        """Wait for a Ctrl-C's wakeup byte; end the command where the main thread does not see it in time."""
        with woken:
            while self._watched(woken):
                pass

    def _watched(self, woken: socket.socket) -> bool:
        """One wakeup: False once the block has ended (`__exit__` closed the writer)."""
        try:
            got = woken.recv(64)
        except OSError:
            return False
        if got and signal.SIGINT in got:
            deadline = time.monotonic() + self.grace_s
            while not self.seen and self._wakeup is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            if not self.seen and self._wakeup is not None:
                print(f"tv-ray {self.name}: interrupted" if self.name else "tv-ray: interrupted", file=sys.stderr)
                _kill_descendants()
                if self.hint is not None:
                    self.hint()
                sys.stderr.flush()
                os._exit(INTERRUPTED)
        return bool(got)

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.set_wakeup_fd(self._earlier)
            writer, self._wakeup = self._wakeup, None
            writer.close()
            signal.signal(signal.SIGINT, self.previous)
            sys.unraisablehook = self.hook


@functools.cache
def _forgotten_in_forks() -> None:
    """A process forked from this one (stage generation's workers) drops the wakeup socket: its own Ctrl-C must
    not wake this process's watcher, which would wait for a signal this process never got (registered once)."""
    os.register_at_fork(after_in_child=_forget_wakeup)


def _forget_wakeup() -> None:
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:          # forked from another thread than the main one: no wakeup fd to drop there
        pass


def cmd_verify(args: argparse.Namespace) -> int:
    from tv_ray.api import verify
    from tv_ray.diagnose import explain
    recipe = [flag for flag in args.model_flags if flag != "--model"]     # they build a plan: never ignore them
    them = "it" if len(recipe) == 1 else "them"
    if args.resume is not None:
        if args.plan is not None or args.model is not None:
            print("tv-ray verify: --resume OUT continues the run recorded in OUT; give no plan or --model",
                  file=sys.stderr)
            return 2
        if recipe:
            print(f"tv-ray verify: --resume OUT continues with the plan recorded in OUT; {', '.join(recipe)} "
                  f"(for building a plan with --model) would be ignored: drop {them}", file=sys.stderr)
            return 2
        args.output = args.output or args.resume
    elif (args.plan is None) == (args.model is None):
        print("tv-ray verify: give a plan file or --model NAME --parallel SPEC (not both)", file=sys.stderr)
        return 2
    elif args.plan is not None and recipe:
        print(f"tv-ray verify: the plan file {args.plan} is verified as written; {', '.join(recipe)} (for "
              f"building a plan with --model) would be ignored: drop {them}, or give --model NAME instead of the "
              f"plan file", file=sys.stderr)
        return 2
    elif args.output is None:
        print("tv-ray verify: -o OUT is required (where the certificate or report goes)", file=sys.stderr)
        return 2
    if args.model is not None and args.parallel is None:
        print("tv-ray verify: --model needs --parallel SPEC, e.g. --parallel dp=2,tp=2", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        with Interrupts("verify", lambda: _resume_hint(args.output)) as interrupts:
            result = verify(args.plan or args.model, args.parallel, optim=args.optim, clip=args.clip, sp=args.sp,
                            zero=args.zero, dims=parse_dims(args.dims) or None, tied=args.tied, masked=args.masked,
                            solvers=args.solvers, timeout=args.timeout,
                            jobs=args.jobs, progress=False if args.quiet else None, seed=args.seed,
                            symmetry=not args.no_symmetry, templates=not args.no_templates, engine=args.engine,
                            address=args.address,
                            checkpoint=args.output, resume=args.resume is not None,
                            shards={"auto": None, "on": True, "off": False}[args.shards])
            interrupts.check()
            written = result.save(args.output)
    except KeyboardInterrupt:
        stopped = _stop_ray()
        print("tv-ray verify: interrupted", file=sys.stderr)
        _resume_hint(args.output)
        if not stopped:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(INTERRUPTED)
        return INTERRUPTED
    except (TvRayError, OSError, ValueError) as err:
        print(f"tv-ray verify: {_one_line(err)}", file=sys.stderr)
        _resume_hint(args.output)
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
    held_to_exit(result)
    return EXIT[result.status]


def _resume_hint(out: str | None) -> None:
    if out is not None and (Path(out) / "checkpoint" / "run.json").exists():
        print(f"tv-ray verify: the verdicts so far are in {out}/checkpoint; continue with "
              f"`tv-ray verify --resume {out}`", file=sys.stderr)


def _stop_ray(wait_s: float = STOP_S) -> bool:
    """Stop the Ray this process started (its dashboard and agents go with it), if it started one; a cluster
    it joined keeps running. False when Ray's shutdown did not end within `wait_s` (a local Ray interrupted half
    started, whose GCS never answers, keeps Ray's driver waiting up to its reconnect limit, `DRIVER_RECONNECT_S`:
    ten minutes); then every process below this one (that Ray's) is killed, and the caller must end at once
    (`os._exit`), for Ray's exit hook would wait again."""
    ray = sys.modules.get("ray")
    if ray is None:
        return True
    stopper = threading.Thread(target=_shutdown, args=(ray,), name="stop-ray", daemon=True)
    stopper.start()
    stopper.join(wait_s)
    if not stopper.is_alive():
        return True
    _kill_descendants()
    return False


def _kill_descendants() -> None:
    """Kill every process below this one."""
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:        # gone already
            pass


def _shutdown(ray) -> None:
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 — an interrupt may leave Ray half started; shutdown does what it can
        pass


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (Linux: read from /proc), each before its own children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # the parent is the second field after the command in parentheses (which may hold spaces)
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmd_check(args: argparse.Namespace) -> int:
    from tv_ray.certificate import check_certificate
    try:
        with Interrupts("check") as interrupts:
            report = check_certificate(args.out, sample=args.sample, solvers=args.solvers, timeout_s=args.timeout,
                                       allow_same_method=args.allow_same_method,
                                       progress=False if args.quiet else None, workers=args.jobs)
            interrupts.check()
    except CertificateError as err:
        print(f"tv-ray check: FAILED: {_one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tv-ray check: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (TvRayError, OSError) as err:
        print(f"tv-ray check: {_one_line(err)}", file=sys.stderr)
        return 2
    same = f", {report.same_method} only by the recorded one (--allow-same-method)" if report.same_method else ""
    print(f"tv-ray check: OK — {report.obligations} obligations, {report.unique} unique keys; re-proved "
          f"{report.resolved} by a different method than recorded{same} ({json.dumps(report.methods)}) in "
          f"{report.seconds:.2f}s")
    print(f"  {' · '.join(f'{phase} {seconds:.1f}s' for phase, seconds in report.phases.items())}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from tv_ray.diagnose import explain
    out = Path(args.out)
    if (out / "report.json").exists():
        print(explain(json.loads((out / "report.json").read_text())))
        return 0
    if (out / "certificate.json").exists():
        print(explain_certificate(json.loads((out / "certificate.json").read_text()), out))
        return 0
    print(f"tv-ray explain: {out} has neither report.json nor certificate.json", file=sys.stderr)
    return 2


def explain_certificate(m: dict, out: Path) -> str:
    """A certificate's summary for a person: what was proved equal to what, on which mesh (in its axis order,
    which rank numbers follow), with which recipe."""
    from tv_ray.diagnose import describe_reference
    from tv_ray.plan import Plan
    c, p = m["counts"], m["plan"]
    mesh = "×".join(f"{a}={n}" for a, n in Plan.load(out / p["path"]).mesh) if (out / p["path"]).exists() \
        else json.dumps(p["mesh"])
    lines = [f"tv-ray: PROVED — {p['model']} on {p['ranks']} ranks (mesh {mesh}, {p['microbatches']} "
             f"microbatch{'es' if p['microbatches'] != 1 else ''}) equals {describe_reference(m.get('reference'))}",
             f"  {c['obligations']} obligations, {c['unique']} unique keys, by tier {json.dumps(m['tiers'])}"]
    recipe = (m.get("reference") or {}).get("recipe")
    if recipe:
        lines.append(f"  recipe: parallel {recipe.get('parallel') or '-'} (sp: sequence parallel, zero=N: ZeRO "
                     f"stage), optimizer {recipe['optim']}, "
                     + (f"clipping at global norm {recipe['clip']:g}" if recipe.get("clip") else "no clipping")
                     + ("" if recipe.get("tied") is None else ", tied embeddings" if recipe["tied"]
                        else ", untied embeddings") + (", masked targets" if recipe.get("masked") else ""))
    else:
        lines.append("  recipe: not recorded in the plan (what was proved is the plan as written)")
    lines.append(f"  reduced dims {json.dumps(m['reduction']['reduced'])}; axioms {m['axioms'] or 'none'}")
    return "\n".join(lines)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    verify = sub.add_parser("verify", help="prove a plan equals the single-device step, or locate the bug",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("plan", nargs="?", help="a plan file (tv-ray-plan/1), or build one with --model below")
    add_model_flags(verify.add_argument_group("building the plan from a model (instead of a plan file)"),
                    required=False)
    verify.add_argument("-o", "--output", metavar="OUT", help="directory for the certificate/report and checkpoint")
    verify.add_argument("--solvers", type=solver_list, default=("z3", "cvc5", "yices"), metavar="NAMES",
                        help="tier 2 portfolio, comma-separated (default: z3,cvc5,yices)")
    verify.add_argument("--timeout", type=seconds, default=10.0, metavar="S",
                        help="per-equation solver timeout in seconds (default: %(default)s)")
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
    verify.add_argument("--no-templates", action="store_true",
                        help="build every stage's formula instead of keying repeated stages by their template "
                             "(docs/templates.md)")
    verify.add_argument("--shards", choices=("auto", "on", "off"), default="auto",
                        help="generate the stages one pipeline stage per shard, in parallel (auto: for plans of "
                             "a million ops or more)")
    verify.add_argument("--seed", type=int, default=0,
                        help="seed of the concrete runs and random points (default: %(default)s)")
    verify.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    verify.set_defaults(func=cmd_verify)
    check = sub.add_parser("check", help="re-validate a certificate independently")
    check.add_argument("out", metavar="OUT", help="the directory `tv-ray verify -o` wrote")
    check.add_argument("--sample", type=int, default=None, metavar="N", help="re-solve N unique keys (default all)")
    check.add_argument("--solvers", type=solver_list, default=("z3", "yices"), metavar="NAMES",
                       help="solvers for re-proving, comma-separated (default: z3,yices)")
    check.add_argument("--timeout", type=seconds, default=10.0, metavar="S",
                       help="per-equation solver timeout in seconds (default: %(default)s)")
    check.add_argument("--jobs", type=processes, default=os.cpu_count() or 1, metavar="N",
                       help="processes re-deriving the stages of a plan generated in pipeline shards (default: "
                            "every core, %(default)s here)")
    check.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    check.add_argument("--allow-same-method", action="store_true",
                       help="accept keys that only their recorded method re-proves (the check is then not "
                            "independent for them; default: such a key fails the check)")
    check.set_defaults(func=cmd_check)
    explain = sub.add_parser("explain", help="print a verification report for a person")
    explain.add_argument("out", metavar="OUT")
    explain.set_defaults(func=cmd_explain)


__all__ = ["add_parsers", "add_model_flags", "cmd_verify", "cmd_check", "cmd_explain", "EXIT"]
