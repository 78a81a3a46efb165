"""The one exception root of tv_ray and its few typed subclasses, each carrying what it is about as fields.

The message says what, where and what to do; the fields say the where again
for code (``err.node``, ``err.path``, ...), so no caller parses a message::

    >>> err = GraphError("node y = neg(x): ...", node="y", program="tp0")
    >>> err.node, err.program, err.path
    ('y', 'tp0', None)

Every field is a keyword argument defaulting to None; an unknown one is a
TypeError, so a misspelt field fails where it is raised.
"""
from __future__ import annotations


class TvRayError(Exception):
    """Root of every error tv_ray raises on purpose.

    The message says what is wrong, where (node, rank, file, JSON path) and,
    where there is one, what to do about it. `FIELDS` names the keyword
    arguments a class takes; each is stored as an attribute (None when not given).
    """

    FIELDS: tuple[str, ...] = ()

    def __init__(self, *args: object, **fields: object) -> None:
        unknown = sorted(set(fields) - set(self.FIELDS))
        if unknown:
            raise TypeError(f"{type(self).__name__} takes no field {unknown[0]!r} "
                            f"(it takes: {', '.join(self.FIELDS) or 'none'})")
        super().__init__(*args)
        for name in self.FIELDS:
            setattr(self, name, fields.get(name))

    def fields(self) -> dict[str, object]:
        """The fields by name, e.g. to re-raise with a longer message: ``type(err)(text, **err.fields())``."""
        return {name: getattr(self, name) for name in self.FIELDS}


class ShapeError(TvRayError):
    """A tensor shape or shape expression is inconsistent; `node` names the node when there is one."""

    FIELDS = ("node",)


class UnknownOpError(TvRayError):
    """An op name (or an op's rule) that tv_ray does not know; `op` is that name."""

    FIELDS = ("op",)


class GraphError(TvRayError):
    """A graph or program is malformed (dangling name, bad attribute, …).

    `node` names the bad node, `program` the graph it is in, `path` the JSON path when decoding.
    """

    FIELDS = ("node", "program", "path")


class PlanError(TvRayError):
    """A plan file or plan object is malformed; the message starts with its JSON path, which is `path`.

    `node` names the op when the problem is one op of a program (a lint failure).
    """

    FIELDS = ("path", "node")


class CaptureError(TvRayError):
    """A torch module could not be captured into a logical graph; `node` names the node when there is one."""

    FIELDS = ("node",)


class TraceFailed(CaptureError):
    """A rank of a traced training script (`tv-ray trace`) failed: the message holds its rank and traceback."""


class ParallelConfigError(TvRayError):
    """A parallel recipe cannot be applied to this model (names the failing constraint); `node` the logical node."""

    FIELDS = ("node",)


class SimulationError(TvRayError):
    """Executing a plan's programs failed (deadlock, mismatched collectives, …); `rank` and `node` say where."""

    FIELDS = ("rank", "node")


class ClaimsMissing(TvRayError):
    """Symmetry failed during stage generation and the mirrored ranks have no claims of their own (only the
    ranks that run their own program were given claims): `tv_ray.partition.derive` makes theirs and cuts again."""


class CommunicationError(SimulationError):
    """The plan's communication cannot complete — a deadlock, mismatched collectives, a message of the wrong
    shape: the plan cannot compute the step at all, which the verifier reports as a refutation."""


class SymbolicError(TvRayError):
    """An op cannot be interpreted symbolically here (e.g. ints depending on two data elements); `node` names it."""

    FIELDS = ("node",)


class TermError(TvRayError):
    """A term could not be built (bad constant, non-integer exponent, malformed table); `term` when there is one."""

    FIELDS = ("term",)


class NormaliseError(TermError):
    """The term has no normal form (division by zero, log of zero), or computing it exceeds the budget."""


class OutsideDomain(TermError):
    """A point lies outside the domain of a term (zero denominator, log of a non-positive value, exp too large):
    the random-point tier draws another point."""


class EncodeError(TvRayError):
    """A term cannot be encoded as a meaningful SMT query (e.g. a constant zero denominator); `term` is it."""

    FIELDS = ("term",)


class Unshardable(TvRayError):
    """A pipeline shard cannot stand for the whole run here (a value crossing shards is not a claim's
    continuation, or not the one the other shard sent); the run is then made whole.

    `rank` and `tensor` name the value that crossed.
    """

    FIELDS = ("rank", "tensor")


class Asymmetric(TvRayError):
    """Data-parallel or microbatch symmetry does not hold (or cannot be shown) for a renaming.

    Control flow inside stage generation: the run is repeated with every rank in
    full. A handler of TvRayError around generation code must let it through.
    `rank` and `node` say where it broke.
    """

    FIELDS = ("rank", "node")


class StageCycle(TvRayError):
    """The stage DAG has a cycle: stages whose proofs would rest on each other. `members` names some of the
    stages on it, in order."""

    FIELDS = ("members",)


class NoReplay(TvRayError):
    """A solver's model cannot be replayed exactly (it needs exp/log values, an irrational number, or gives an
    application two values): the solver's "sat" stays unknown."""


class JointTaken(TvRayError):
    """Raised inside torch's `aot_export_module` once its joint graph is made, ending the export before it re-traces
    that graph (`tv_ray.frontend.trace`); never escapes `trace_joint`."""

    def __init__(self, graph):
        super().__init__("joint graph taken")
        self.graph = graph


class SolverUnavailable(TvRayError):
    """An SMT backend cannot run here (not installed, binary missing, library broken); the message says which.
    `solver` is the backend's name."""

    FIELDS = ("solver",)


class SolverBusy(TvRayError):
    """An SMT backend is still running an earlier check that did not stop at its timeout; `solver` names it."""

    FIELDS = ("solver",)


class SettingsError(TvRayError):
    """A verification setting that cannot be used (an unknown solver, a timeout that is not positive, a plan
    path that names neither a file nor a built-in model); `setting` names it."""

    FIELDS = ("setting",)


class CheckpointError(TvRayError):
    """A checkpoint that cannot be resumed (another plan, other settings, unreadable); `path` is the file."""

    FIELDS = ("path",)


class EngineError(TvRayError):
    """The engine cannot go on (the cluster is gone, no actor can be placed); the message says what.

    `address` is the Ray cluster's, when known.
    """

    FIELDS = ("address",)


class CertificateError(TvRayError):
    """A certificate does not check: a changed byte, a missing or altered obligation, a plan edited after
    verification, a composition that does not hold, or a key the checker could not re-prove.

    `path` is the file and `obligation` the obligation id, when the failure is about one.
    """

    FIELDS = ("path", "obligation")
