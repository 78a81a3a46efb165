"""Layer j's ops taken as a neighbouring layer's renamed, without stepping them.

A transformer repeats one block, so layer j of a rank's program computes what
layer j−1 computes on other tensors. Let τ be the renaming of variables that
maps every atom of a logical tensor of layer i to the atom with the same index
of the tensor at the same place in layer i+1 (weights, optimizer state and ops
alike), for every i at once, and leaves every other tensor's atoms alone.
`LayerShift.of` reads off the logical graph where τ holds: `renames` (T and τT
of one shape, each its own atoms or the very same closed terms, so τ takes
T's value to τT's), `alike` (besides, the same op and attributes, τT's
arguments τ of T's, an argument outside the layers the very same tensor), and
τ keeps the logical order of what it renames and of what layers share (stage
keys number a formula's tensors in that order). τ is a bijection on the
variables it moves: layer i's tensors go one to one to layer i+1's, and
nothing outside the layers is an image.

Each op of layer j on a rank (its microbatch 0, or an op of no microbatch) is
paired once per program with the op at its place among the ops of the same
phase of the neighbouring layer run just before it (`layer_counterparts`:
layer j−1 for a forward or an optimizer step, layer j+1 for a backward; d is
that offset, the renaming τ or τ⁻¹). At the op, each argument it reads must be
the renaming of what the counterpart read: a value taken so from that very
value (`LayerDeferred`, identity, the same d) or the value the counterpart read
taken so from this one (the opposite d: a backward op reads its layer's forward
activation, taken as the layer before's renamed), a claim's continuation whose
claim is the counterpart's renamed (the same slice of the renamed tensor), a
free part of a partial cut paired with the counterpart's (τ takes the one's
free atoms to the other's), or the very same value, which τ leaves alone (no
atom of any layer's tensor, no free part, no data choice). Then the op's value
is the counterpart's renamed (a renaming of variables commutes with every
symbolic rule; the rank, so its coordinate, is the same). It is kept as the op
on its arguments, not computed (a `Deferred`: built only if something asks,
giving what stepping would have). Whether it is cut must agree with its
counterpart. At a whole or sliced cut whose claim is the counterpart's renamed
on an alike tensor, the stage's formula — the ops since the last cuts on the
values read, against the claimed tensor's op on its arguments' values — is
the counterpart stage's renamed: valid exactly when that one is, and with its
key. So it is recorded with that key and no terms, as a template hit is; a
partial cut is cut as stepping cuts it, and its group's stage takes the
counterpart group's key where every member's part was taken so
(docs/templates.md, "Layer j as layer j−1 renamed"). A counterpart stage whose
formula was unfolded by the definitions of some logical tensors is followed
only where each of them is alike (τ of the equation it was unfolded by is the
graph's own). Anything else — a contribution sum across the dp blocks, an
argument that is not the counterpart's renamed, a stage unfolded by a tensor
τ does not show alike — is stepped as before:
the pairing is a hypothesis each op's arguments confirm, never an assumption
that layers are alike.
"""
from __future__ import annotations

import re
from difflib import SequenceMatcher

import numpy as np

from tv_ray.ir import Graph, Node, Op
from tv_ray.partition.ids import Part, StageId
from tv_ray.partition.lazy import Continued, Deferred, Free, terms_of
from tv_ray.terms import Kind, Term, postorder
from tv_ray.terms.atom import Atom

LAYER = re.compile(r"^layers\.(\d+)(?=\.|$)")          # an op's module path in a layer
INPUT_LAYER = re.compile(r"(?:^|/)layers\.(\d+)\.")      # a weight's (or its optimizer state's) name


def layer_of(module: str) -> int | None:
    """The layer a module path lies in (None: none)."""
    found = LAYER.match(module)
    return int(found.group(1)) if found else None


def layers_of(nodes, known: dict[str, int] | None = None) -> dict[str, int]:
    """The layer of each op (in graph order) in one: its module's, or for an op of no module (autograd's sum of the
    gradients a tensor read twice gets, between a layer's backward ops; an optimizer's running sum of squared
    gradient norms) the layer of its argument latest in the graph that lies in one — unless it reads an op of a
    module outside the layers (a final norm's). Only a proposal: `LayerShift.of` and the run check what it
    pairs."""
    out = dict(known or {})
    at: dict[str, int] = {}
    outside: set[str] = set()
    for i, node in enumerate(nodes):
        at[node.name] = i
        module = node.get_meta("module") or ""
        layer = layer_of(module)
        if layer is None and module:
            outside.add(node.name)
        elif layer is None and not any(a in outside for a in node.args):
            placed = [a for a in node.args if a in out]
            if placed:
                layer = out[max(placed, key=lambda a: at.get(a, -1))]
        if layer is not None:
            out[node.name] = layer
    return out


class LayerShift:
    """τ on the logical graph: each tensor of layer i → the tensor at the same place in layer i+1, where both are
    their own atoms throughout and of one shape (`renames`: τ moves their atoms index for index); the tensors among
    those whose op the graph shows alike (`alike`); every layer's tensors (`layered`); why τ is empty (`notes`)."""

    def __init__(self, renames: dict[str, str], alike: frozenset[str], layered: frozenset[str], notes: list[str]):
        self.renames, self.alike, self.layered, self.notes = renames, alike, layered, notes
        self.preimages = {y: x for x, y in renames.items()}             # τ⁻¹ (τ is one to one)
        self.alike_images = frozenset(renames[x] for x in alike)

    @staticmethod
    def of(graph: Graph, logical) -> "LayerShift":
        """τ where the graph shows it (`logical`: its `LogicalTerms`, which tell a tensor that is its own atoms)."""
        specs = {s.name: s for s in graph.inputs}
        nodes = {n.name: n for n in graph.nodes}
        placed, images = layer_images(graph)
        layered = frozenset(placed)
        renames: dict[str, str] = {}
        for x, y in images.items():
            a, b = (specs[x], specs[y]) if x in specs else (nodes[x], nodes[y])
            if a.shape == b.shape and a.dtype == b.dtype and _renamed_value(logical, x, y):
                renames[x] = y
        alike = set()
        for x, y in renames.items():
            if x in specs:
                a, b = specs[x], specs[y]
                if (a.role, a.high, a.positive, a.ignore) == (b.role, b.high, b.positive, b.ignore):
                    alike.add(x)
                continue
            a, b = nodes[x], nodes[y]
            if a.op is b.op and a.attrs == b.attrs and a.get_meta("phase") == b.get_meta("phase") and \
                    len(a.args) == len(b.args) and \
                    all(renames.get(p) == q if p in layered else p == q for p, q in zip(a.args, b.args)):
                alike.add(x)
        # keys number a formula's tensors in logical order: τ must keep the order of the tensors it renames and of
        # those it leaves alone that layers share (a rotary table, the clipping coefficient), for τ of a formula
        # to have its key (a stage taken so is τ of one either way: its proof is one)
        readers: dict[str, set[int]] = {}
        for node in graph.nodes:
            if node.name in placed:
                for a in node.args:
                    if a not in layered:
                        readers.setdefault(a, set()).add(placed[node.name])
        order = logical.order
        kept = sorted((name for name in order if name in renames or len(readers.get(name, ())) > 1),
                      key=order.__getitem__)
        moved = [order[renames.get(name, name)] for name in kept]
        for i in range(len(kept) - 1):
            if moved[i + 1] <= moved[i]:
                a, b = kept[i], kept[i + 1]
                return LayerShift({}, frozenset(), layered, [
                    f"layers: renaming layer i to layer i+1 changes the logical order of the tensors ({a} before "
                    f"{b}, {renames.get(a, a)} after {renames.get(b, b)}); every layer stepped"])
        return LayerShift(renames, frozenset(alike), layered, [])

    def maps(self, first, other, alike: bool = False) -> bool:
        """Is claim `other` τ of claim `first`: the same slice of the image of its tensor (with `alike`, a tensor
        whose op the graph shows alike with its image's)?"""
        return self.renames.get(first.logical) == other.logical and (not alike or first.logical in self.alike) and \
            other.offsets == first.offsets and other.shape == first.shape and other.partial == first.partial and \
            other.boundary == first.boundary and other.given == first.given and other.scale == first.scale

    def fixes(self, value) -> bool:
        """Does τ leave the value alone: no atom of a layer's tensor (moved by τ or not: the image of one), no free
        part or opaque value, no data choice?"""
        if isinstance(value, Continued):
            return value.claim.logical not in self.layered
        flat = np.asarray(terms_of(value), dtype=object).reshape(-1)
        for node in postorder(*[t for t in flat if isinstance(t, Term)]):
            if node.kind is Kind.VAR and isinstance(node.payload, Atom):
                base = node.payload.base
                if isinstance(base, (Part, StageId)) or base in self.layered:
                    return False
        return all(isinstance(t, Term) for t in flat)


def _renamed_value(logical, x: str, y: str) -> bool:
    """Is tensor y's value tensor x's with x's atoms renamed to y's, index for index: both their own atoms
    throughout, or element by element either each its own atom or the very same closed term (a masked score's
    -inf)?"""
    if logical.atomic(x) and logical.atomic(y):
        return True
    if logical.atomic(x) or logical.atomic(y) or x not in logical.value or y not in logical.value:
        return False
    a, b = logical.value[x], logical.value[y]
    if a.shape != b.shape:
        return False
    for u, v in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist()):
        if isinstance(u, Term) and u.kind is Kind.VAR:
            if not (isinstance(v, Term) and v.kind is Kind.VAR and isinstance(u.payload, Atom) and
                    isinstance(v.payload, Atom) and u.payload.base == x and v.payload.base == y and
                    u.payload.idx == v.payload.idx and u.payload.onehot is None and v.payload.onehot is None):
                return False
        elif u is not v or not isinstance(u, Term) or any(t.kind is Kind.VAR for t in postorder(u)):
            return False
    return True


_SHIFTS: dict[int, tuple] = {}


def layer_images(graph: Graph) -> tuple[dict[str, int], dict[str, str]]:
    """The layer of each tensor of the logical graph in one (an op, a weight or its optimizer state), and each
    tensor of layer i → the one at the same place in layer i+1 (`aligned`, ops with ops and inputs with inputs).
    A proposal only: `LayerShift.of` keeps the pairs the graph shows τ on, and the claims are first guessed
    by it (`tv_ray.partition.claims.infer_claims`: a guess every concrete run must confirm)."""
    by_layer: dict[tuple[str, int], list] = {}
    inputs = {}
    for spec in graph.inputs:
        found = INPUT_LAYER.search(spec.name)
        if found:
            inputs[spec.name] = int(found.group(1))
            by_layer.setdefault(("input", int(found.group(1))), []).append(spec)
    placed = layers_of(graph.nodes, inputs)
    for node in graph.nodes:
        if node.name in placed:
            by_layer.setdefault(("op", placed[node.name]), []).append(node)
    images = {}
    for (kind, i), items in by_layer.items():
        if (kind, i + 1) in by_layer:
            images.update(aligned(items, by_layer[kind, i + 1]))
    return placed, images


def layer_shift(graph: Graph, logical) -> LayerShift:
    """`LayerShift.of`, once per logical graph built (the pipeline shards of one job share it)."""
    found = _SHIFTS.get(id(logical))
    if found is None or found[0] is not logical:
        _SHIFTS.clear()
        found = _SHIFTS[id(logical)] = logical, LayerShift.of(graph, logical)
    return found[1]


def layer_counterparts(program: Graph) -> dict[str, tuple[str, int]]:
    """Each op of layer j (its microbatch 0, or of no microbatch) → (the op at the same place among the ops of the
    neighbouring layer that runs just before it, of the same phase (`aligned`), and that layer's offset: -1 for layer
    j−1 (a forward, an optimizer step), +1 for layer j+1 (a backward)), where that op comes first in the program."""
    by_layer: dict[tuple, list[Node]] = {}
    placed = layers_of(program.nodes)
    for node in program.nodes:
        mb = node.get_meta("mb")
        if mb in (0, None) and node.name in placed and node.op not in (Op.SEND, Op.RECV):
            # (a pipeline hop carries its neighbour's module)
            by_layer.setdefault((mb, node.get_meta("phase"), placed[node.name]), []).append(node)
    at = {node.name: i for i, node in enumerate(program.nodes)}
    pairs = {}
    for (mb, phase, i), nodes in by_layer.items():
        start = at[nodes[0].name]
        before = [(at[by_layer[mb, phase, i + d][0].name], d) for d in (-1, 1)
                  if (mb, phase, i + d) in by_layer and at[by_layer[mb, phase, i + d][0].name] < start]
        if before:
            d = max(before)[1]
            pairs.update((y, (x, d)) for x, y in aligned(by_layer[mb, phase, i + d], nodes) if at[x] < at[y])
    return pairs


def aligned(first: list, then: list) -> list[tuple[str, str]]:
    """Layer i's ops (or tensors) `first` and layer i+1's `then` paired where they line up: the longest runs of the
    same op (kind, attributes, shape, dtype, arity, phase, module within the layer; for inputs shape, dtype, role
    and name within the layer) in the same order (a lowering may add an op to one layer: the embedding's
    all-reduce at the first one's norm, say)."""
    matcher = SequenceMatcher(None, [_signature(x) for x in first], [_signature(y) for y in then], autojunk=False)
    return [(first[a + j].name, then[b + j].name) for a, b, size in matcher.get_matching_blocks() for j in range(size)]


def _signature(item) -> tuple:
    if isinstance(item, Node):
        module = item.get_meta("module") or ""
        return item.op, item.attrs, item.shape, item.dtype, len(item.args), item.get_meta("phase"), \
            LAYER.sub("", module)
    return item.shape, item.dtype, item.role, INPUT_LAYER.sub("/", item.name)


class LayerDeferred(Deferred):
    """An op of layer j taken as its counterpart's value `image` renamed from layer j−d (`LayerRenamed`): the op on
    its arguments, computed only if something asks (then as stepping would have)."""

    __slots__ = ("image", "d")

    def __init__(self, node: Node, args: list, dims: dict[str, int], ctx, shape: tuple[int, ...], image, d: int):
        super().__init__(node, args, dims, ctx, shape)
        self.image, self.d = image, d


class LayerRenamed:
    """The ops of a `SymbolicRun` taken as a neighbouring layer's renamed (a mixin: it reads the run's claims,
    sources, stages, templates and stand-ins)."""

    def _pair_layers(self, plan, logical, on: bool) -> None:
        self._programs = plan.programs
        self.layers = layer_shift(plan.logical, logical) if on else None
        if self.layers is not None and not self.layers.alike:
            self.layers = None
        # program -> op -> (its counterpart, their arguments side by side, d)
        self._layer_pairing: dict[str, dict[str, tuple]] = {}
        # program -> the counterparts and what they read: their values are kept (`_kept`, with microbatch 0's)
        self._layer_images: dict[str, frozenset[str]] = {}
        # each stage with a key, by id -> its index and the tensors its formula was unfolded by (`_keyed`)
        self._keyed_at: dict[StageId, tuple[int, frozenset[str]]] = {}
        self._fixed_by_tau: dict[int, dict] = {}  # rank -> id(value) -> (value, does τ leave it alone)
        # a partial cut whose parts are taken so: (its counterpart's group stage, d) of each member's part so far
        self._layer_parts: dict[StageId, dict[int, tuple]] = {}
        self.layer_renamed = 0            # ops taken as a neighbouring layer's renamed

    def _layer_program(self, name: str) -> dict[str, tuple]:
        found = self._layer_pairing.get(name)
        if found is None:
            program = self._programs[name]
            nodes = {n.name: n for n in program.nodes}
            pairs = layer_counterparts(program)
            found = self._layer_pairing[name] = {op: (base, tuple(zip(nodes[op].args, nodes[base].args)), d)
                                                 for op, (base, d) in pairs.items()}
            bases = [base for base, _ in pairs.values()]
            self._layer_images[name] = frozenset(bases).union(*(nodes[b].args for b in bases))
        return found

    def _keep_layer(self, rank: int, program: str, name: str, value) -> None:
        """After an op (or a program input) on a stepped rank: its value, for the op of the next layer paired
        with it."""
        if self.layers is not None and rank not in self.mirrored:
            self._layer_program(program)
            if name in self._layer_images[program]:
                self._kept.setdefault(rank, {})[name] = value

    def _keyed(self, unfolded: frozenset[str]) -> None:
        """The stage just recorded has a key, its formula unfolded by the definitions of the tensors `unfolded`
        (`expand`): τ of it may take that key where τ renames those definitions too (`_keyed_stage`); the op of the
        neighbouring layer finds it by id."""
        if self.layers is not None:
            self._keyed_at[self.obligations[-1].id] = len(self.obligations) - 1, unfolded

    def _keyed_stage(self, cid: StageId, d: int) -> tuple[int, frozenset[str]] | None:
        """The counterpart stage `cid`'s index, and the tensors the renamed stage's formula is unfolded by (τ of
        its own for d = -1, τ⁻¹ for d = +1), where its key serves the renamed stage: each tensor its formula was
        unfolded by has a definition the logical graph shows renamed (alike) — so τ of the equation it was
        unfolded by is the graph's own; else None."""
        found = self._keyed_at.get(cid)
        if found is None:
            return None
        at, unfolded = found
        if not unfolded:
            return found
        step = self.layers.renames if d < 0 else self.layers.preimages
        alike = self.layers.alike if d < 0 else self.layers.alike_images
        if not unfolded <= alike:
            return None
        return at, frozenset(step[t] for t in unfolded)

    def _layer_renamed(self, state, node: Node) -> bool:
        """Take the op as its counterpart's renamed (the module docstring); False: step it."""
        if self.layers is None or state.rank in self.mirrored:
            return False
        paired = self._layer_program(state.name).get(node.name)
        kept = self._kept.get(state.rank)
        if paired is None or kept is None or paired[0] not in kept or (state.rank, paired[0]) in self.opaque:
            return False
        base, args, d = paired
        env, values = state.env, []
        pairing = self._layer_pairing[state.name]
        for mine, theirs in args:
            value = env[mine]
            if not self._layer_image(state.rank, value, kept.get(theirs), mine == theirs, d, pairing):
                return False
            values.append(value)
        rank = state.rank
        if rank in self.mirrors_of and not self._renamed_throughout(rank, node):
            return False
        claim, first = (self.claims.get((rank, node.name)), self.claims.get((rank, base))) if node.dtype == "float" \
            else (None, None)
        if claim is not None or first is not None:      # a cut, as its counterpart is (else they differ)
            return claim is not None and first is not None and self._layer_cut(state, node, base, claim, first,
                                                                                 values, d)
        value = LayerDeferred(node, values, self.dims, state.ctx, self._shape(node), kept[base], d)
        if not self._shallow(value):
            return False
        self.sources[rank, node.name] = self._reads(state, node)
        if self.templates is not None:
            self.provenance[rank, node.name] = self._provenance(state, node, value)
        self._memoize(state, node, values, value)
        self._kept_after(state, node, value)
        return True

    def _layer_image(self, rank: int, value, theirs, same: bool, d: int, pairing: dict) -> bool:
        """Is `value` what the counterpart read there, `theirs`, renamed from its layer j−d to layer j (τ for d = -1,
        τ⁻¹ for d = +1; `same`: the very tensor of the program)? A free part of a partial cut is its counterpart
        cut's renamed where the cuts pair (τ takes the free atoms of the one to the other's)."""
        if type(theirs) is LayerDeferred and theirs.image is value and theirs.d == -d:
            return True         # the counterpart read this value renamed the other way (τ⁻¹ of τ, or τ of τ⁻¹)
        if isinstance(value, LayerDeferred):
            return value.image is theirs and value.d == d
        if not same:
            if type(value) is Free:
                return type(theirs) is Free and value.position == theirs.position and value.size == theirs.size and \
                    value.cid.ranks == theirs.cid.ranks and pairing.get(value.cid.tensor, ())[::2] == \
                    (theirs.cid.tensor, d) and self._layer_maps(theirs.claim, value.claim, d)
            return type(value) is Continued and type(theirs) is Continued and \
                self._layer_maps(theirs.claim, value.claim, d)
        if value is not theirs:
            return False
        cache = self._fixed_by_tau.setdefault(rank, {})
        found = cache.get(id(value))
        if found is None or found[0] is not value:
            found = cache[id(value)] = value, self.layers.fixes(value)
        return found[1]

    def _layer_maps(self, theirs, mine, d: int, alike: bool = False) -> bool:
        """Is claim `mine` the counterpart's claim `theirs` renamed from layer j−d to layer j (`LayerShift.maps`)?"""
        return self.layers.maps(theirs, mine, alike) if d < 0 else self.layers.maps(mine, theirs, alike)

    def _layer_cut(self, state, node: Node, base: str, claim, first, args: list, d: int) -> bool:
        """A cut whose claim is the counterpart's claim `first` renamed, that stage's key found without unfolding:
        recorded with that key, as `_cut` would record it, and the run continues from the claim."""
        rank = state.rank
        if not self._layer_maps(first, claim, d, alike=True):
            return False
        if claim.partial:
            return self._layer_part(state, node, base, claim, args, d)
        found = self._keyed_stage(StageId("r", (rank,), base), d)
        value = Deferred(node, args, self.dims, state.ctx, self._shape(node))
        if found is None or self.obligations[found[0]].notes or not self._shallow(value):
            return False
        cid = StageId("r", (rank,), node.name)
        reads = self._reads(state, node)
        self.sources[rank, node.name] = frozenset({cid})
        self._append_keyed(cid, (rank,), state, node, claim, self.obligations[found[0]].key, reads, found[1])
        self._memoize(state, node, args, value)
        self._remember((rank,), node, claim, [value])
        self._staged(rank, node)
        out = self._continuation(rank, claim)
        self._copy_mirrors(state)
        if self.templates is not None:
            self.provenance[rank, node.name] = self._continued(rank, (rank,), claim, cid, out)
        self._kept_after(state, node, out)
        return True

    def _layer_part(self, state, node: Node, base: str, claim, args: list, d: int) -> bool:
        """A group member's part of a partial claim whose counterpart's group stage has a key found without unfolding:
        cut as stepping cuts it (`_cut`), its group's stage recorded with that key where every member's part is taken
        so (`_layer_group`)."""
        rank = state.rank
        members = self.members(rank, claim.partial)
        first = StageId.group(members, base)
        if self._keyed_stage(first, d) is None or any(m in self.mirrored for m in members) or \
                self._contributes(members, claim):
            return False
        value = Deferred(node, args, self.dims, state.ctx, self._shape(node))
        if not self._shallow(value):
            return False
        made = self._provenance(state, node, value) if self.templates is not None else None
        self._memoize(state, node, args, value)
        self._layer_parts.setdefault(StageId.group(members, node.name), {})[rank] = first, d
        out, made = self._cut(state, node, value, claim, made, None)
        self.provenance[rank, node.name] = made
        self._kept_after(state, node, out)
        return True

    def _layer_group(self, cid, members, state, node: Node, claim, values, reads) -> bool:
        """A partial claim's group complete (`_cut`): where every member's part was taken as its counterpart's renamed
        (`_layer_part`), all from one counterpart group whose stage has a key found without unfolding, the group's
        stage is that one renamed — recorded with its key."""
        taken = self._layer_parts.pop(cid, None) if self.layers is not None else None
        if taken is None or len(taken) != len(members) or len(set(taken.values())) != 1:
            return False
        found = self._keyed_stage(*next(iter(taken.values())))
        if found is None or self.obligations[found[0]].notes:
            return False
        first, unfolded = self.obligations[found[0]], found[1]
        self._append_keyed(cid, members, state, node, claim, first.key, reads, unfolded)
        self._remember(members, node, claim, values)
        return True

    def _append_keyed(self, cid, members, state, node: Node, claim, key: str, reads, unfolded: frozenset[str]) -> None:
        """Record the stage with its counterpart's key, no terms built (as a template hit is); its formula is the
        counterpart's renamed, so unfolded by the renamed tensors `unfolded`."""
        self._append(cid, members, state, node, claim, key, reads)
        self._keyed_at[cid] = len(self.obligations) - 1, unfolded
        self.templated += 1

    def _kept_after(self, state, node: Node, value) -> None:
        """What `_advance` leaves after the op: its value kept for microbatch k's and the next layer's ops, the
        rank stepped past it."""
        self._keep(state, node, value)
        self._keep_layer(state.rank, state.name, node.name, value)
        self.layer_renamed += 1
        self._passed(state, node, value)


__all__ = ["LayerShift", "LayerRenamed", "LayerDeferred", "layer_shift", "layer_counterparts", "layer_of"]
