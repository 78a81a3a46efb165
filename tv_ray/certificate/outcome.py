"""Outcomes: the typed verdict of each unique key and of a whole run — Proved, Refuted or Unknown, nothing else.

A key's `Verdict` is made from what a tier returned (`Verdict.of`), travels
through the engine (workers, the checkpoint) and lands in the certificate
or the report unchanged. A run's `Outcome` decides the run's status once,
from its verdicts, its composition problems and its concrete runs:

- refuted: the plan's communication cannot complete, or a stage is refuted
  and the concrete runs show it (some program output differs from its
  lineage, or the refuted stage's own value differs from its claim) —
  soundness rule 5: a counterexample is replayed before it is reported;
- proved: every obligation proved and the composition holds;
- unknown: anything else, with the reasons.

Diagnosis (`tv_ray.diagnose`) explains an outcome; it never changes its status.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction

import numpy as np

from tv_ray.partition.claims import Claims, ConcreteRun, group_value
from tv_ray.partition.stages import Obligation, Partition
from tv_ray.reduce import Reduction
from tv_ray.simulate import max_abs_deviation
from tv_ray.plan import Plan
from tv_ray.terms.result import Proved, Refuted, Unknown

# a refuted stage whose value differs from its claim by more than REPLAY_ATOL + REPLAY_RTOL * |claim| at some
# element in a concrete run is a bug: ten times the tolerance claims are matched by value with
# (tv_ray.partition.claims), so a claim guessed from those runs is never confirmed wrong by them, and far
# above float64 rounding (a balance loss's divisor 32 changed to 32.001 moves gradients of 3e-3 by 5e-10)
REPLAY_ATOL, REPLAY_RTOL = 1e-11, 1e-8


class Status(str, Enum):
    """The three verdicts. A str, so it serialises as "proved" / "refuted" / "unknown"."""

    PROVED = "proved"
    REFUTED = "refuted"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


@dataclass
class Verdict:
    """How one unique key was discharged."""

    verdict: Status
    tier: int                        # the highest tier that was needed (0, 1, 2)
    method: str                      # normalised | random-point | smt:<solver> | engine | …, joined by +
    seconds: float = 0.0
    axioms: tuple[str, ...] = ()
    reason: str = ""
    element: int | None = None       # for a refutation: which equation
    point: dict[str, str] = field(default_factory=dict)   # for a refutation: variable -> exact value
    values: tuple[str, str] = ("", "")                     # lhs, rhs there

    def __post_init__(self):
        self.verdict = Status(self.verdict)      # a status outside the three is an error, not a verdict

    @staticmethod
    def of(result: Proved | Refuted | Unknown, tier: int, seconds: float, element: int | None = None,
           method: str | None = None, axioms: tuple[str, ...] = ()) -> "Verdict":
        """The verdict a tier's result gives a key (`element`: the equation a refutation or unknown is about)."""
        if isinstance(result, Proved):
            return Verdict(Status.PROVED, tier, method or result.method, seconds, axioms or result.axioms)
        if isinstance(result, Refuted):
            return Verdict(Status.REFUTED, tier, method or "refuted", seconds, axioms, element=element,
                           point={str(k): str(v) for k, v in sorted(result.point.items(), key=lambda kv: str(kv[0]))},
                           values=(_fmt(result.lhs_value), _fmt(result.rhs_value)))
        if isinstance(result, Unknown):
            return Verdict(Status.UNKNOWN, tier, method or "none", seconds, axioms, reason=result.reason)
        raise TypeError(f"a tier returned {type(result).__name__}, not Proved, Refuted or Unknown")

    @property
    def proved(self) -> bool:
        return self.verdict is Status.PROVED

    def to_json(self) -> dict:
        out = {"verdict": self.verdict.value, "tier": self.tier, "method": self.method,
               "seconds": round(self.seconds, 6)}
        if self.axioms:
            out["axioms"] = list(self.axioms)
        if self.reason:
            out["reason"] = self.reason
        if self.element is not None:
            out.update(element=self.element, point=self.point, values=list(self.values))
        return out


def _fmt(v) -> str:
    return str(v) if isinstance(v, Fraction) else str(v)[:40]


@dataclass
class Replay:
    """A stage's value against its claim in the concrete run where they differ most."""

    deviation: float
    run: int
    physical: np.ndarray
    logical: np.ndarray

    @property
    def confirms(self) -> bool:
        """Does the stage's value differ from its claim past rounding (`REPLAY_ATOL`, `REPLAY_RTOL`)?"""
        physical, logical = np.asarray(self.physical, float), np.asarray(self.logical, float)
        with np.errstate(invalid="ignore"):
            close = (np.abs(physical - logical) <= REPLAY_ATOL + REPLAY_RTOL * np.abs(logical)) | (physical == logical)
        return physical.shape != logical.shape or not bool(close.all())


def replays(runs: list[ConcreteRun], ob: Obligation) -> list[Replay]:
    """The stage's physical value (summed over its group for a partial claim) against its claim's value, in every
    concrete run that holds it."""
    out = []
    for i, run in enumerate(runs):
        physical = group_value(run, ob.ranks, ob.tensor)
        if physical is not None:
            logical = ob.claim.value(run.logical[ob.claim.logical])
            out.append(Replay(max_abs_deviation(physical, logical), i, physical, logical))
    return out


def replay_stage(runs: list[ConcreteRun], ob: Obligation) -> Replay | None:
    """`replays` in the concrete run where the two differ most; None when no run holds the stage."""
    return max(replays(runs, ob), key=lambda r: r.deviation, default=None)


@dataclass
class Outcome:
    """Everything a run found: the basis of a certificate (proved) or a report (refuted / unknown)."""

    plan: Plan
    reduction: Reduction
    partition: Partition
    runs: list[ConcreteRun]
    claims: Claims
    verdicts: dict[str, Verdict]               # key -> verdict
    problems: list[str] = field(default_factory=list)     # composition failures (never proved then)
    phases: dict[str, float] = field(default_factory=dict)
    executor: str = ""
    dropped: list[tuple[int, str]] = field(default_factory=list)   # claims refuted as wrong guesses
    deviations: list[dict] = field(default_factory=list)   # program outputs wrong in the concrete runs
    failure: str = ""            # the plan's communication cannot complete (a refutation without stages)
    resumed: int = 0             # unique keys whose verdicts came from the checkpoint
    status: Status = field(init=False)
    unconfirmed: str = field(init=False, default="")     # why a refuted stage is not reported as a bug

    def __post_init__(self):
        self.status = self._decide()

    def _decide(self) -> Status:
        if self.failure:
            return Status.REFUTED
        first = self.first_refuted()
        if first is not None:
            if self.deviations or any(r.confirms for r in replays(self.runs, first)):
                return Status.REFUTED
            self.unconfirmed = (f"stage {first.id} is refuted symbolically, but no program output differs from the "
                                f"logical step in the concrete runs; not reported as a bug")
            return Status.UNKNOWN
        if self.problems or not self.partition.obligations or \
                any(not self.verdict_of(o).proved for o in self.partition.obligations):
            return Status.UNKNOWN
        return Status.PROVED

    @property
    def proved(self) -> bool:
        return self.status is Status.PROVED

    def verdict_of(self, ob: Obligation) -> Verdict:
        return self.verdicts[ob.key]

    def counts(self) -> dict[str, int]:
        c = Counter()
        for key, n in self.partition.key_counts().items():
            c[self.verdicts[key].verdict] += n
        return {"obligations": self.partition.size, "unique": len(self.verdicts),
                "proved": c[Status.PROVED], "refuted": c[Status.REFUTED], "unknown": c[Status.UNKNOWN]}

    def tiers(self) -> dict[str, int]:
        """Unique keys by how they closed: normalised, random-point, smt:<solver>, unknown."""
        c = Counter((v.method if v.verdict is not Status.UNKNOWN else "unknown") for v in self.verdicts.values())
        return dict(sorted(c.items()))

    def first_refuted(self) -> Obligation | None:
        """The refuted stage first in dataflow (stage order) — of the same op refuted on several ranks (every
        data-parallel replica's), the one on the lowest rank."""
        bad = [o for o in self.partition.obligations if self.verdict_of(o).verdict is Status.REFUTED]
        if not bad:
            return None
        first = min(bad, key=lambda o: o.position)
        return min((o for o in bad if (o.program, o.tensor, o.mb) == (first.program, first.tensor, first.mb)),
                   key=lambda o: (o.ranks, o.position))


__all__ = ["Status", "Verdict", "Outcome", "Replay", "replay_stage", "replays", "REPLAY_ATOL", "REPLAY_RTOL"]
