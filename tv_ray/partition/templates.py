"""Stage templates: a stage's structure, keyed before its terms are built, so a repeated stage is not built again.

A stage's formula — its physical ops applied to the values it read, against
its claim's logical definition — is a function of

- the physical ops since the last cuts: op, attributes and shapes at the
  reduced dims (`Templates.signature`), and how they are wired; an op that
  reads the rank's mesh coordinate (`local_chunk`, `axis_index`) also the
  rank's position on its axes — the one thing of the rank a program reads;
- each value it read: the claim it continues from (its logical tensor, the
  slice's offsets and shape, the axes it is a partial sum over, and for a
  free part of a partial claim the member's position in its group and the
  group's size) — a continuation is the logical tensor's atoms on the slice,
  except the elements whose definition is a constant (`Templates.klass`
  hashes where they are and what they are);
- the claim it must meet: its logical tensor and slice, and that tensor's
  logical op, attributes and arguments (each with its `klass`).

Logical tensors enter by *first-occurrence number* within the stage (which
of them are the same tensor), never by name or layer, together with their
order in the logical graph (which comes first). Two stages with the
same descriptor therefore have formulas that are the same up to renaming
each logical tensor's atoms to the other's (and each free part's): one is
valid exactly when the other is (a renamed valid formula is valid), so the
second stage is the first one's obligation renamed: it takes the first one's key (the renaming keeps the
tensors' logical order, which is all the key's numbering reads, so it is its own formula's key too) and
its terms are never built.
docs/templates.md gives the argument and what is *not* templated:

- a stage whose formula needed unfolding of logical intermediates (`expand`
  changed it), unless the first instance's unfolding carries over: unfolding
  reads the logical graph beyond the descriptor, so the first instance keeps
  how, relative to its numbering (`Unfolding`), and an instance takes its key
  only where the definitions it was unfolded by read alike there
  (`Templates.unfolded`; docs/templates.md, "Unfolded stages");
- a stage that read a mirrored, moved or accumulated value, an opaque op,
  or a collective with a member stood in for:
  built in full as before (a group's stage — the sum of its members' parts —
  and a collective's result are ops like any other: `parts`, `collective`;
  a contribution sum's stage, dp block 0's parts against blocks [0, width)'s
  contribution, adds what that contribution is built from: `descriptor`;
  so does a dp block 0 member's continuation after one: `contributed`);
- cones of more than `MAX_CONE` ops.

Offsets are absolute, so stages of different tensor-parallel ranks (which
hold other slices) are different templates; layers share them — except for an
*aligned* stage (`Templates.aligned`): elementwise ops on one region of
same-shaped tensors made of their own atoms (and whole 0-d tensors), cut at
an elementwise logical op, such as an optimizer's update of a weight shard.
Its formula at element i reads element i of each region alone, so the region's
offsets are written relative (the same stage on another tensor-parallel or
ZeRO shard is a renaming of it: every atom index shifted by the offsets'
difference); docs/templates.md, "Aligned stages".
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

from tv_ray.ir import Node, Op
from tv_ray.ir.ops import ELEMENTWISE
from tv_ray.partition.claims import Claim
from tv_ray.partition.ids import StageId
from tv_ray.partition.logical import LogicalTerms, own_atom
from tv_ray.semantics.table import Context, instantiate_attrs, instantiate_shape
from tv_ray.terms import Kind, Term, postorder

MAX_CONE = 64          # physical ops since the last cuts beyond which a stage is not templated
COORDINATE_OPS = frozenset({Op.AXIS_INDEX, Op.LOCAL_CHUNK})   # their value is a function of the rank's coordinate
TEMPLATE_VERSION = b"tv-ray-template/4"
ALIGNED_OPS = frozenset(str(op) for op in ELEMENTWISE)     # as a signature names them


def leaf(claim: Claim) -> tuple:
    """The provenance of a value continued from a whole or sliced claim."""
    return ("c", claim, 1)


def part(claim: Claim, position: int, size: int, cid: StageId) -> tuple:
    """The provenance of group member `position`'s free part of a partial claim over `size` ranks."""
    return ("p", claim, 1, position, size, cid)


def contributed(claim: Claim, width: int) -> tuple:
    """The provenance of what a dp block 0 member continues from after a contribution sum across the dp
    blocks: blocks [0, width)'s contribution to the claim's slice (`LogicalTerms.contribution_of`)."""
    return ("k", claim, 1, width)


class Unfolding(NamedTuple):
    """How the first instance of a template was unfolded (`expand`), relative to its descriptor's numbering: the
    numbering extended to the unfolded tensors' arguments (`steps`), the numbers of the tensors unfolded, each
    number's class and samples' tag beyond the descriptor's (and the unfolded tensors'), every number in the
    tensors' logical order (`ranks`), and the key."""

    key: str
    steps: tuple
    unfolded: tuple
    rows: tuple
    ranks: tuple


class Templates:
    """Stage descriptors (one table per symbolic run): `built` maps a template one instance has built to that
    formula's key — every instance's, since their formulas are renamings of it that keep the tensors' logical
    order (`tv_ray.partition.keys` numbers tensors in that order) — or to "" when it needed unfolding (an instance
    is then built, under its own formula's key, unless the first one's unfolding carries over: `unfolded`)."""

    def __init__(self, logical: LogicalTerms, dims: dict[str, int]):
        self.logical, self.dims = logical, dims
        self.built: dict[str, str] = {}
        self.first_unfolded: dict[str, Unfolding] = {}     # template -> how its first instance was unfolded
        self._renamable: dict[str, bool] = {}
        self._signatures: dict[int, tuple] = {}
        self._classes: dict[str, str] = {}
        self._last: tuple = (None, None, "", 0)  # (provenance, claim, template, width) of the last descriptor

    def signature(self, node: Node) -> tuple:
        """An op as the formula sees it: op, attributes and shape at the reduced dims, dtype."""
        sig = self._signatures.get(id(node))
        if sig is None:
            sig = self._signatures[id(node)] = (str(node.op), tuple(sorted(instantiate_attrs(node, self.dims).items())),
                                                tuple(instantiate_shape(node.shape, self.dims)), node.dtype)
        return sig

    def op(self, node: Node, args: list, ctx: Context) -> tuple | None:
        """The provenance of an op's value from its arguments' (None when any is unknown or the cone is large);
        an op that reads the rank's coordinate (`COORDINATE_OPS`) holds the rank's position on those axes."""
        sig = self.signature(node)
        if node.op in COORDINATE_OPS:
            sig = sig + (("at", ctx.group_position(node.attr["axes"])),)
        return self._combined(sig, args)

    def parts(self, made: list) -> tuple | None:
        """The provenance of a group's stage value: the sum of its members' parts, in member order."""
        return self._combined(("parts", len(made)), made)

    def collective(self, node: Node, made: list, position: int) -> tuple | None:
        """The provenance of group member `position`'s result of a collective over members whose inputs have
        `made` (in member order): the group rule of its op and attributes on those inputs."""
        return self._combined(self.signature(node) + (("at", position),), made)

    def _combined(self, sig: tuple, made: list) -> tuple | None:
        if any(a is None for a in made):
            return None
        size = 1 + sum(a[2] for a in made)
        return None if size > MAX_CONE else ("o", sig, size, tuple(made))

    def klass(self, tensor: str) -> str:
        """A logical tensor as its atoms and definition show it: op, attributes, shape, dtype, its arguments'
        ops and shapes, and every element of its value that is not its own atom (constants where the
        definition is constant; the whole value of a tensor that is not computed from float inputs)."""
        found = self._classes.get(tensor)
        if found is not None:
            return found
        lt = self.logical
        node = lt.nodes.get(tensor)
        h = hashlib.sha256(repr((self._shallow(tensor), lt.shape_of(tensor),
                                 None if node is None else [self._shallow(a) for a in node.args])).encode())
        if not lt.atomic(tensor):           # (an atomic tensor's every element is its own atom)
            value = lt.full(tensor)
            for idx in np.ndindex(value.shape):
                x = value[idx]
                if own_atom(x, tensor, idx):
                    continue         # its own atom: renamed with the tensor
                h.update(repr(idx).encode())
                h.update(x.digest if isinstance(x, Term) else repr(x).encode())
        found = self._classes[tensor] = h.hexdigest()
        return found

    def known(self, template: str) -> bool:
        """Was an instance of the template built (one unfolded: kept so that it may carry over)?"""
        return bool(self.built.get(template)) or template in self.first_unfolded

    def taken(self, template: str, numbers: dict) -> tuple[str, frozenset[str]] | None:
        """The key an instance of `template` (its descriptor's `numbers`) takes without being built, and the tensors
        its formula is unfolded by: a template built before, or one unfolded whose unfolding carries over
        (`unfolded`); None: build it."""
        key = self.built.get(template)
        return (key, frozenset()) if key else self.unfolded(template, numbers) if key == "" else None

    def record(self, template: str, numbers: dict, key: str, unfolded: frozenset[str]) -> None:
        """An instance of `template` was built with key `key`, unfolded by `unfolded`: unfolding read the logical
        graph beyond the descriptor, so such a template lends its key only where that reads alike too (the first
        instance's `unfolding` is kept)."""
        self.built[template] = "" if unfolded else key
        first = self.unfolding(numbers, unfolded, key) if unfolded else None
        if first is not None:
            self.first_unfolded.setdefault(template, first)

    def unfolding(self, numbers: dict, unfolded: frozenset[str], key: str) -> Unfolding | None:
        """A stage with key `key`, its formula unfolded by the definitions of `unfolded`, as an `Unfolding` relative
        to its descriptor's `numbers`, where `extension` finds one (docs/templates.md, "Unfolded stages")."""
        found = self.extension(numbers, unfolded)
        if found is None:
            return None
        ext, steps = found
        order = self.logical.order
        rows = tuple((n, self.klass(t), self._tag(t)) for t, n in sorted(ext.items(), key=lambda x: x[1])
                     if t in unfolded or n >= len(numbers))
        ranks = tuple(ext[t] for t in sorted(ext, key=order.__getitem__))
        return Unfolding(key, steps, tuple(sorted(ext[t] for t in unfolded)), rows, ranks)

    def extension(self, numbers: dict, unfolded: frozenset[str]) -> tuple[dict[str, int], tuple] | None:
        """The descriptor's numbering of tensors extended to the arguments of each unfolded tensor, each numbered
        tensor's arguments in order (`steps`: (its number, argument position, the argument's number)); None where
        an unfolded tensor is not reached so, is an input, or has an argument whose value is neither its own atoms
        nor closed terms (another tensor's atoms there would not be renamed with the rest)."""
        ext = {t: n for t, n in numbers.items() if isinstance(t, str)}
        fresh = len(numbers)
        steps, done = [], set()
        order = self.logical.order
        while len(done) < len(unfolded):
            ready = sorted((t for t in unfolded if t not in done and t in ext), key=order.__getitem__)
            if not ready:
                return None
            for tensor in ready:
                node = self.logical.nodes.get(tensor)
                if node is None:
                    return None
                for i, a in enumerate(node.args):
                    if not self._renamed_with_tensor(a):
                        return None
                    if a not in ext:
                        ext[a], fresh = fresh, fresh + 1
                    steps.append((ext[tensor], i, ext[a]))
                done.add(tensor)
        return ext, tuple(steps)

    def unfolded(self, template: str, numbers: dict) -> tuple[str, frozenset[str]] | None:
        """The key of an instance of `template` whose first instance was unfolded (`first_unfolded`), and the
        tensors this instance's formula is unfolded by, where its numbering extends as the first one's did to
        tensors of the same classes in the same logical order; else None."""
        kept = self.first_unfolded.get(template)
        if kept is None:
            return None
        tensors = {n: t for t, n in numbers.items() if isinstance(t, str)}
        for parent, i, n in kept.steps:
            node = self.logical.nodes.get(tensors.get(parent))
            if node is None or i >= len(node.args) or not self._renamed_with_tensor(node.args[i]):
                return None
            a = node.args[i]
            if tensors.setdefault(n, a) != a:
                return None
        if len(set(tensors.values())) != len(tensors):
            return None         # two numbers on one tensor: not the first instance's renamed
        if any(n not in tensors or self.klass(tensors[n]) != klass or self._tag(tensors[n]) != tag
               for n, klass, tag in kept.rows):
            return None
        order = self.logical.order
        if tuple(sorted(tensors, key=lambda n: order[tensors[n]])) != kept.ranks:
            return None
        return kept.key, frozenset(tensors[n] for n in kept.unfolded)

    def _tag(self, tensor: str) -> str:
        """The tensor's samples' tag, as a row writes it."""
        return repr(self.logical.blocks.tags.get(tensor) if self.logical.blocks is not None else None)

    def _renamed_with_tensor(self, tensor: str) -> bool:
        """Is every element of the tensor's value its own atom or a closed term?"""
        found = self._renamable.get(tensor)
        if found is None:
            found = self.logical.atomic(tensor) or tensor in self.logical.value and all(
                own_atom(x, tensor, idx) or not isinstance(x, Term) or
                (x.kind is not Kind.VAR and not any(t.kind is Kind.VAR for t in postorder(x)))
                for idx, x in np.ndenumerate(self.logical.value[tensor]))
            self._renamable[tensor] = found
        return found

    def _atoms_only(self, tensor: str, full: tuple) -> bool:
        """Is `tensor` of shape `full`, each element its own atom?"""
        return self.logical.atomic(tensor) and self.logical.shape_of(tensor) == full

    def _scalar(self, tensor: str) -> bool:
        return self.logical.shape_of(tensor) == ()

    def aligned(self, provenance: tuple, claim: Claim) -> bool:
        """Is the stage elementwise on one region (docs/templates.md, "Aligned stages")? Its claim is not partial
        and its logical op is elementwise on arguments that are whole 0-d tensors or, like the claimed tensor,
        of one shape and made of their own atoms; every op since the last cuts is elementwise with the claim's
        shape or 0-d; every value it read continues from the claim's very region of such a tensor, or from a
        whole 0-d tensor. Then element i of its formula reads element i of each region and the 0-d values
        alone, and the same stage at other offsets is this one with every region's atom indices shifted."""
        node = self.logical.nodes.get(claim.logical)
        if claim.partial or node is None or node.op not in ELEMENTWISE:
            return False
        full = self.logical.shape_of(claim.logical)
        if not self._atoms_only(claim.logical, full) or \
                not all(self._scalar(a) or self._atoms_only(a, full) for a in node.args):
            return False
        stack, seen = [provenance], set()
        while stack:
            p = stack.pop()
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p[0] == "o":
                sig = p[1]
                if sig[0] not in ALIGNED_OPS or len(sig) != 4 or sig[2] not in (claim.shape, ()):
                    return False
                stack.extend(p[3])
            elif p[0] != "c" or p[1].partial:
                return False
            elif not self._scalar(p[1].logical) and ((p[1].offsets, p[1].shape) != (claim.offsets, claim.shape)
                                                     or not self._atoms_only(p[1].logical, full)):
                return False
        return True

    def _shallow(self, tensor: str) -> tuple:
        node = self.logical.nodes.get(tensor)
        if node is None:
            spec = self.logical.graph.value(tensor)
            return ("input", spec.dtype, tuple(instantiate_shape(spec.shape, self.dims)))
        return self.signature(node)

    def descriptor(self, provenance: tuple, claim: Claim, width: int = 0) -> str:
        """The template of the stage whose computed value has `provenance`, cut at `claim` (see the module
        docstring): the SHA-256 of its descriptor. With `width`, the stage of a contribution sum: its value is
        dp block 0's part, its claim blocks [0, width)'s contribution (`LogicalTerms.contribution_of`), which
        adds the tensors that contribution is built from, each with its samples' dimension. The last one is
        kept: a claimed op not computed (`SymbolicRun._deferred`) asks for it again when its stage is recorded."""
        if self._last[0] is provenance and self._last[1] is claim and self._last[3] == width:
            return self._last[2]
        numbers: dict = {}
        rows: list = []
        memo: dict[int, int] = {}
        # an aligned stage's region is written "=" wherever it lies (`aligned`); 0-d tensors have no offsets
        region = (claim.offsets, claim.shape) if not width and self.aligned(provenance, claim) else None

        def number(thing) -> int:
            return numbers.setdefault(thing, len(numbers))

        def claim_row(c: Claim) -> tuple:
            offsets = "=" if (c.offsets, c.shape) == region else c.offsets
            row = (number(c.logical), self.klass(c.logical), offsets, c.shape, c.partial)
            return row if c.scale == 1 else row + (str(c.scale),)

        def contribution_rows(tensor: str) -> tuple:      # what a contribution to `tensor` is built from
            tags = self.logical.blocks.tags
            return tuple((number(t), self.klass(t), repr(tags.get(t))) for t in self.logical.contribution_sources(tensor))

        stack = [(provenance, False)]
        while stack:                  # post-order over the provenance DAG, shared nodes once
            p, expanded = stack.pop()
            if id(p) in memo:
                continue
            if p[0] == "o" and not expanded:
                stack.append((p, True))
                stack.extend((a, False) for a in reversed(p[3]) if id(a) not in memo)
                continue
            if p[0] == "c":
                row = ("c",) + claim_row(p[1])
            elif p[0] == "p":
                row = ("p",) + claim_row(p[1]) + (p[3], p[4], number(("part", p[5])))
            elif p[0] == "k":
                row = ("k",) + claim_row(p[1]) + (p[3], contribution_rows(p[1].logical))
            else:
                row = ("o", p[1], tuple(memo[id(a)] for a in p[3]))
            memo[id(p)] = len(rows)
            rows.append(row)
        node = self.logical.nodes.get(claim.logical)
        args = () if node is None else tuple((number(a), self.klass(a)) for a in node.args)
        contributed = contribution_rows(claim.logical) if width else ()
        self.numbers = numbers       # which number each tensor and part got (what a renaming maps)
        order = self.logical.order
        ranks = tuple(sorted((t for t in numbers if isinstance(t, str)), key=order.__getitem__))
        template = hashlib.sha256(TEMPLATE_VERSION + repr((rows, claim_row(claim), args, width, contributed,
                                                           tuple(numbers[t] for t in ranks),
                                                           region is not None)).encode()).hexdigest()
        self._last = (provenance, claim, template, width)
        return template


__all__ = ["Templates", "leaf", "part", "contributed", "MAX_CONE", "COORDINATE_OPS", "TEMPLATE_VERSION"]
