"""The Python API: capture a model's training step, parallelize it into a plan, simulate it, verify it.

Example::

    import tv_ray
    graph = tv_ray.capture_step("llama3-tiny", optim="adamw", clip=1.0)
    plan = tv_ray.parallelize(graph, "dp=2,tp=2,pp=2,mb=2", model="llama3-tiny", sp=True)
    plan.save("plan.json")
    print(tv_ray.simulate(plan, seed=0).max_abs_dev())
    result = tv_ray.verify(plan, jobs=2)
    result.proved, result.save("out/")
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from tv_ray.errors import CaptureError, ParallelConfigError, PlanError, SettingsError, TvRayError
from tv_ray.frontend.capture import capture, masked_targets
from tv_ray.frontend.optim import RECIPE, capture_step as _capture_step
from tv_ray.ir.graph import Graph
from tv_ray.models import ModelSpec, get, list_models
from tv_ray.parallel.recipe import parallelize as _parallelize
from tv_ray.parallel.spec import ParallelSpec
from tv_ray.plan import Plan
from tv_ray.plan_check import checked_beside
from tv_ray.processes import Forked, gc_paused
from tv_ray.simulate import simulate

if TYPE_CHECKING:
    from tv_ray.certificate.outcome import Outcome


def _spec(model: str | ModelSpec, dims: Mapping[str, int] | None, tied: bool | None) -> ModelSpec:
    spec = get(model) if isinstance(model, str) else model
    changes = {"tied": tied} if tied is not None else {}
    if dims:
        return spec.with_dims({**spec.dims, **dims}, **changes)
    return spec.with_dims(**changes) if changes else spec


def capture_step(model, inputs=None, *, optim: str = RECIPE["optim"], clip: float | None = RECIPE["clip"],
                 tied: bool | None = None,
                 dims: Mapping[str, int] | None = None, int_highs: Mapping[str, int] | None = None,
                 masked: bool = False, **hyper) -> Graph:
    """The logical graph of one training step (forward, loss, backward, optimizer update).

    `model` is a built-in name (``tv-ray models``), a `ModelSpec`, or any
    ``torch.nn.Module`` whose ``forward(*inputs)`` returns the scalar loss; for
    a module, `int_highs` gives each integer input's range ``[0, high)``
    (token ids: the vocabulary size), e.g. ``{"tokens": 50257, "targets": 50257}``. With `masked` the targets may
    also be the loss's ignore_index (padding): the proofs cover ignored targets.
    """
    if isinstance(model, (str, ModelSpec)):
        model = _spec(model, dims, tied)
        tied = None
    graph = _capture_step(model, inputs, optim=optim, clip=clip, tied=tied, int_highs=int_highs, **hyper)
    if masked:
        graph = masked_targets(graph)
    for spec in graph.inputs:
        if spec.dtype == "int" and spec.high is None:
            raise CaptureError(f"integer input {spec.name!r} needs its range: pass "
                               f"int_highs={{{spec.name!r}: N}} (values lie in [0, N))")
    return graph


def trace(script, world_size: int | None = None) -> Plan:
    """The plan of a torch.distributed training script, every rank run as a gloo process on CPU and recorded
    (the script's contract: `tv_ray.frontend.traced`)::

        plan = tv_ray.trace("docs/examples/dtensor_mlp.py", world_size=2)
        assert tv_ray.verify(plan).proved
    """
    from tv_ray.frontend.traced import trace as traced
    return traced(script, world_size)


def parallelize(graph: Graph, spec: str | ParallelSpec, *, model: str | ModelSpec = "model",
                dims: Mapping[str, int] | None = None, layers: int | None = None,
                recipe: Mapping | None = None, check: bool = True, **flags) -> Plan:
    """The plan that runs `graph` under `spec` (``"dp=2,tp=2,pp=2,mb=2"``; flags sp, zero), validated
    (`check=False`: by the caller, with `tv_ray.plan_check.check_plan`).

    For a built-in model, pass its name as `model`; its dims and layer count
    are taken from it, and `recipe` (``{"optim": "adamw", "clip": 1.0, "tied": None}``, how `graph` was
    captured) is recorded in the plan with the parallel spec so that verification can capture the model again and say whether
    the plan's logical graph is that capture. For another graph pass `dims` (the full value of every named
    dim its shapes use; none for a graph with constant shapes).
    """
    if isinstance(spec, str):
        spec = ParallelSpec.parse(spec, **flags)
    elif flags:
        raise ParallelConfigError(f"flags {sorted(flags)} given with a ParallelSpec; set them on it")
    name = model if isinstance(model, str) else model.name
    if isinstance(model, ModelSpec) or model in list_models():
        model_spec = _spec(model, None, None)
        dims = {**model_spec.dims, **(dims or {})}
        layers = layers or model_spec.config.layers
    plan = _parallelize(graph, spec, dict(dims or {}), name, layers=layers, check=check)
    if recipe is not None:
        plan = replace(plan, recipe={"optim": recipe.get("optim", RECIPE["optim"]),
                                     "clip": recipe.get("clip", RECIPE["clip"]), "tied": recipe.get("tied"),
                                     "masked": bool(recipe.get("masked")), "parallel": str(spec)})
    return plan


def reference(plan: Plan, captured: Graph | None = None) -> dict:
    """What every proof of `plan` is about: its logical graph, named by its hash, and — when the plan names
    a built-in model and the recipe it was captured with — whether that graph is a fresh capture of the
    model (`captured`: one made in this run, so not made again). ``capture`` is "matches", "differs" or
    None (nothing to capture again)::

        reference(plan)   # {'logical_sha256': '3f…', 'model': 'llama3-tiny', 'recipe': {...}, 'capture': 'matches'}
    """
    if not _recaptured(plan.model, plan.recipe):
        return _reference(plan, None)
    from tv_ray.certificate.write import logical_digest
    return _reference(plan, logical_digest(captured) if captured is not None else
                      _capture_digest(plan.model, plan.recipe, plan.dims))


def _recaptured(model: str | None, recipe: Mapping | None) -> bool:
    """Is a plan of `model` with `recipe` compared with a fresh capture (a built-in model, its recipe known)?"""
    return recipe is not None and model in list_models()


def _reference(plan: Plan, captured: str | None) -> dict:
    """`reference` of a plan whose model captured afresh has the logical digest `captured` (None: none made)."""
    from tv_ray.certificate.write import logical_digest
    out = {"logical_sha256": logical_digest(plan.logical), "model": plan.model, "recipe": plan.recipe,
           "capture": None}
    if captured is not None:
        out["capture"] = "matches" if captured == out["logical_sha256"] else "differs"
    return out


def _capture_digest(model: str, recipe: Mapping, dims: Mapping[str, int]) -> str:
    """The logical digest of a fresh capture of built-in `model` with `recipe`, at the plan's `dims`."""
    from tv_ray.certificate.write import logical_digest
    spec = get(model)
    dims = {d: dims[d] for d in spec.dim_names if d in dims}
    return logical_digest(capture_step(model, optim=recipe["optim"], clip=recipe["clip"], tied=recipe["tied"],
                                       dims=dims, masked=recipe.get("masked", False)))


def _reference_or_failure(plan: Plan, captured: Graph | None = None) -> dict:
    """`reference`; where the model no longer captures as the plan says, the plan's own graph, with why."""
    try:
        return reference(plan, captured)
    except TvRayError as err:
        return _failed(plan, err)


def _failed(plan: Plan, err: Exception) -> dict:
    return {**_reference(plan, None), "capture": f"failed: {err}"}


class _ForkedReference:
    """The fresh capture of a built-in model (`_capture_digest`) made in a forked process from now on, while the
    caller goes on: 8 s at llama3-70b on one core, beside the reading of the plan and its claims, reduction and
    mirrors (one core) instead of after the whole verification. Begun from a plan file's header (`Plan.header`)
    before the plan is read (`_read_plan` stops it where the plan read in full names another model, recipe or dims);
    `result(plan)` is the plan's `reference` with it — made again here where the process died without answering."""

    def __init__(self, model: str, recipe: Mapping, dims: Mapping[str, int]):
        self.made_for = (model, dict(recipe), dict(dims))
        self._job = Forked(_capture_digest, *self.made_for)

    @staticmethod
    def of(model: str | None, recipe: Mapping | None, dims: Mapping[str, int] | None) -> "_ForkedReference | None":
        """One begun where the model is captured afresh and this process may have children (not a daemonic one)."""
        if not _recaptured(model, recipe) or dims is None or not Forked.possible():
            return None
        return _ForkedReference(model, recipe, dims)

    def result(self, plan: Plan) -> dict:
        try:
            said = self._job.result()
        except ChildProcessError:
            return _reference_or_failure(plan)
        except TvRayError as err:
            return _failed(plan, err)
        return _reference(plan, said)

    def stop(self) -> None:
        """Not needed (any more): the verification failed, or the plan is not what the header said."""
        self._job.stop()


@dataclass(repr=False)
class Result:
    """The outcome of `verify`: `.proved`, `.status` (proved / refuted / unknown), the report, and `.save`.

    `print(result)` shows the report's headline; `result.outcome` holds everything the run found."""

    outcome: "Outcome"
    report: dict
    settings: dict
    plan_path: str | None = None
    reference: dict | None = None
    certificate: dict | None = field(default=None)

    @property
    def status(self) -> str:
        """The outcome's status, as text: proved, refuted or unknown (the report says the same)."""
        return self.outcome.status.value

    @property
    def proved(self) -> bool:
        return self.outcome.proved

    def __repr__(self) -> str:
        c = self.outcome.counts()
        return (f"<tv_ray.Result {self.status}: {self.report.get('headline', '')} ({c['obligations']} obligations, "
                f"{c['unique']} unique keys)>")

    @property
    def counterexample(self) -> dict | None:
        """The first failing stage with its replayed values, when refuted."""
        return self.report.get("stage") if self.status == "refuted" else None

    @gc_paused()        # as `verify` is: writing walks the stages it holds (llama3-405b: 11 s of collections)
    def save(self, out: str | Path) -> Path:
        """Write OUT/certificate.json + obligations.parquet + instances.parquet (proved) or OUT/report.json with
        the two tables (otherwise)."""
        from tv_ray.certificate.write import write_certificate, write_tables
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if self.proved:
            self.certificate = write_certificate(self.outcome, out, self.plan_path, self.settings, self.reference)
            (out / "report.json").unlink(missing_ok=True)
            return out / "certificate.json"
        write_tables(self.outcome, out)
        (out / "certificate.json").unlink(missing_ok=True)
        (out / "report.json").write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        return out / "report.json"


# the whole job with the cyclic collector paused, not only its generation: between phases each full collection
# walked every term, array and tuple the job holds (llama3-405b at 16 layers: 60.3 s with it, 48.5 s without,
# the same peak); the job builds few cycles, collected once it returns
@gc_paused()
def verify(model_or_plan=None, parallel: str | None = None, *, optim: str = RECIPE["optim"],
           clip: float | None = RECIPE["clip"],
           sp: bool = False, zero: int = 0, dims: Mapping[str, int] | None = None, tied: bool | None = None,
           masked: bool = False,
           solvers=("z3", "cvc5", "yices"), timeout: float = 10.0,
           jobs: int | None = None, progress: bool | None = None, seed: int = 0, executor=None,
           symmetry: bool = True, templates: bool = True, engine: str = "ray", address: str | None = None,
           checkpoint: str | Path | None = None, resume: bool = False, shards: bool | None = None) -> Result:
    """Prove that a plan computes the single-device training step, or find where it does not.

    `model_or_plan` is a `Plan`, a plan file path, or a built-in model name (then `parallel` is required
    and the plan is built as `tv-ray plan` builds it, with `optim`, `clip`, `tied`, `dims` — the model's
    dims overridden, e.g. ``{"batch": 2048}`` — and `sp`, `zero`)::

        result = tv_ray.verify("llama3-tiny", "dp=2,tp=2")
        assert result.proved
        result.save("out")          # out/certificate.json, out/obligations.parquet, out/plan.json

    Solving runs on `engine` "ray" (solver actors on a local Ray using every core, or the cluster at
    `address` / RAY_ADDRESS; `jobs` actors if given) or "local" (this process, or `jobs` processes).
    With `checkpoint=OUT` every verdict streams to OUT/checkpoint; `resume=True` continues the run
    recorded there (its plan and settings), solving only the keys it lacks. `shards`: generate the stages
    one pipeline stage per shard, in parallel (True), in one run (False), or by the plan's size (None).
    `templates=False` builds every stage's formula (no stage keyed by its template: docs/templates.md).
    """
    from tv_ray.diagnose import diagnose
    from tv_ray.engine.checkpoint import Checkpoint
    from tv_ray.engine.driver import verify_plan
    from tv_ray.engine.executor import executor_for
    from tv_ray.engine.solve import Budget
    settings = {"solvers": list(solvers), "timeout_s": timeout, "seed": seed, "symmetry": symmetry, "shards": shards,
                "templates": templates}
    saved = Checkpoint(checkpoint) if checkpoint is not None else None
    plan_path, captured, forked = None, None, None
    if resume:
        if saved is None or model_or_plan is not None:
            raise ParallelConfigError("resume continues the run in checkpoint=OUT: give that, and no plan or model")
        plan, settings = saved.resume()
        plan_path = str(saved.plan_file)
        budget = Budget(solvers=tuple(settings["solvers"]), timeout_s=settings["timeout_s"], seed=settings["seed"])
    else:
        # a solver or timeout that cannot be used fails here, before any capture
        budget = Budget(solvers=tuple(settings["solvers"]), timeout_s=settings["timeout_s"], seed=settings["seed"])
        if isinstance(model_or_plan, Plan) or _is_plan_file(model_or_plan):
            given = [name for name, on in (("parallel", parallel is not None), ("sp", sp), ("zero", zero != 0),
                                           ("tied", tied is not None), ("dims", bool(dims)), ("masked", masked))
                     if on]
            if given:
                raise ParallelConfigError(f"{', '.join(given)} build a plan from a model name; a plan is verified "
                                          "as it is")
            if isinstance(model_or_plan, Plan):
                plan = model_or_plan
            else:
                plan_path = str(Path(model_or_plan).resolve())
                plan, forked = _read_plan(model_or_plan)
        else:
            if parallel is None:
                raise ParallelConfigError("verify a model by name needs parallel=..., e.g. 'dp=2,tp=2'")
            _note(progress, f"capturing {model_or_plan}'s training step ({optim}, "
                            f"{f'clip {clip:g}' if clip else 'no clipping'}) …")
            captured = capture_step(model_or_plan, optim=optim, clip=clip, tied=tied, dims=dims, masked=masked)
            plan = parallelize(captured, parallel, model=model_or_plan, dims=dims, sp=sp, zero=zero,
                               recipe={"optim": optim, "clip": clip, "tied": tied, "masked": masked})
    try:
        # a plan read from a file is validated beside the verification (its error, if any, is the verification's)
        with checked_beside(plan) if plan_path is not None and not resume else contextlib.nullcontext():
            if saved is not None and not resume:
                saved.start(plan, settings, source=plan_path)
            if forked is None and captured is None:   # the model captured again, beside the verification
                forked = _ForkedReference.of(plan.model, plan.recipe, plan.dims)
            executor = executor or executor_for(engine, jobs, address)
            if hasattr(executor, "connect"):
                _note(progress, f"connecting to Ray ({executor.address or 'a new local Ray on this machine'}) …")
            try:
                if hasattr(executor, "connect"):
                    executor.connect()
                outcome = verify_plan(plan, budget=budget, executor=executor, progress=progress,
                                      seed=settings["seed"], symmetry=settings["symmetry"],
                                      templates=settings.get("templates", True), checkpoint=saved,
                                      shards=settings.get("shards"))
            finally:
                executor.close()
    except BaseException as err:
        if forked is not None:
            forked.stop()
        if isinstance(err, PlanError) and saved is not None and not resume:
            saved.discard()             # nothing to resume of a plan that is not valid
        raise
    ref = forked.result(plan) if forked is not None else _reference_or_failure(plan, captured)
    return Result(outcome, diagnose(outcome, ref), settings, plan_path, ref)


def _read_plan(path) -> tuple[Plan, _ForkedReference | None]:
    """The plan file read, and the fresh capture of its model begun from the file's header (`Plan.header`) while it
    is read — stopped where the read fails or the plan read in full is not what the header said."""
    head = Plan.header(path)
    forked = _ForkedReference.of(head.get("model"), head.get("recipe"), head.get("dims"))
    try:
        plan = Plan.load(path, check=False)         # validated beside the verification (`verify`)
    except BaseException:
        if forked is not None:
            forked.stop()
        raise
    if forked is not None and forked.made_for != (plan.model, plan.recipe, dict(plan.dims)):
        forked.stop()
        forked = None
    return plan, forked


def _note(progress: bool | None, text: str) -> None:
    """A line on stderr about a step that takes seconds with nothing else to show (when progress is shown)."""
    if (sys.stderr.isatty() if progress is None else progress):
        print(f"tv-ray: {text}", file=sys.stderr, flush=True)


def _is_plan_file(x) -> bool:
    """A plan file (a path, or a string naming an existing file or ending in .json), not a model name;
    SettingsError for a string that is neither a file nor a built-in model."""
    if isinstance(x, Path):
        return True
    if not isinstance(x, str):
        raise SettingsError(f"verify takes a Plan, a plan file or a built-in model name, not {type(x).__name__}",
                            setting="model_or_plan")
    if Path(x).is_file() or x.endswith(".json"):
        return True
    if x in list_models():
        return False
    raise SettingsError(f"{x}: no such plan file, and not a built-in model ({', '.join(list_models())})",
                        setting="model_or_plan")


__all__ = ["capture", "capture_step", "parallelize", "trace", "reference", "simulate", "verify", "Result", "Plan",
           "ParallelSpec"]
