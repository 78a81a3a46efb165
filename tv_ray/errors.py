"""The one exception root of tv_ray and its few typed subclasses."""
from __future__ import annotations


class TvRayError(Exception):
    """Root of every error tv_ray raises on purpose.

    The message says what is wrong, where (node, rank, file, JSON path) and,
    where there is one, what to do about it.
    """


class ShapeError(TvRayError):
    """A tensor shape or shape expression is inconsistent."""


class UnknownOpError(TvRayError):
    """An op name (or an op's rule) that tv_ray does not know."""


class GraphError(TvRayError):
    """A graph or program is malformed (dangling name, bad attribute, …)."""


class PlanError(TvRayError):
    """A plan file or plan object is malformed; the message starts with its JSON path."""


class CaptureError(TvRayError):
    """A torch module could not be captured into a logical graph."""


class ParallelConfigError(TvRayError):
    """A parallel recipe cannot be applied to this model (names the failing constraint)."""


class SimulationError(TvRayError):
    """Executing a plan's programs failed (deadlock, mismatched collectives, …)."""


class CommunicationError(SimulationError):
    """The plan's communication cannot complete — a deadlock, mismatched collectives, a message of the wrong
    shape: the plan cannot compute the step at all, which the verifier reports as a refutation."""


class CertificateError(TvRayError):
    """A certificate does not check: a changed byte, a missing or altered obligation, a plan edited after
    verification, a composition that does not hold, or a key the checker could not re-prove."""
