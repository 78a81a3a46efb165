"""Layer extrapolation: a deep model's logical graph from its 2-, 3- and 4-layer captures.

Tracing costs time linear in the depth and the layer count is never reduced
(DESIGN.md), so a 126-layer model would be traced 126 layers deep, three
times. Its layers are the same up to their index, so we capture 2 and 3
layers, find what the third layer adds, and repeat that:

- *alignment*: the 2-layer graph's nodes embed, in order, into the 3-layer
  graph's. A node matches one with the same op, attributes, shape, dtype and
  provenance whose arguments are the images of its own or nodes of the new
  layer (the *ports*: the final norm now reads layer 2's output). The nodes
  left over are the *block* — runs of consecutive nodes (forward, backward) —
  and the inputs and outputs left over are layer 2's parameters and gradients
  (``<container>.2.*``).
- *layer shift*: each run sits next to its layer-1 copy: before it in the
  forward, after it in the backward (which visits the layers in reverse).
  That copy gives each block node its *counterpart*, and comparing their
  arguments says what each argument is: the layer's own node or parameter, a
  value all layers share (RoPE tables, the mask), the previous layer's output
  (forward chain) or the next layer's (backward chain, where the last layer
  reads the gradient coming from the loss).
- *repeat*: graph(k) holds copies for layers 2..k-1, wired by those reads,
  with parameter, gradient and module names at their own layer index.
- *check*: repeated to 4 layers, the pattern must equal a real 4-layer capture
  node for node, up to node names. Otherwise the layers do not repeat and we
  refuse; ``capture(spec, extrapolate=False)`` traces every layer instead.

A model whose first layers differ (DeepSeek-V3's three dense layers before
the MoE ones) is captured at b, b + 1 and b + 2 layers instead, b the first
layer whose predecessor is its twin (its config's ``repeats_from``): the
layers before b are context like the embedding.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from tv_ray.errors import CaptureError, GraphError
from tv_ray.ir import Graph, Node, TensorSpec, check_names, describe

def probe_layers(first: int = 2) -> tuple[int, int, int]:
    """The depths captured when the new layer of the middle capture is layer `first` (its twin `first` - 1)."""
    return first, first + 1, first + 2

# How a block node's argument is read by the copy for layer j (of `newest` + 1 layers).
OWN = "own"          # the layer's own node: copy j's
PARAM = "param"      # the layer's own parameter: renamed to layer j
SHARED = "shared"    # a value every layer reads (RoPE tables, mask): as is
PREV = "prev"        # the previous layer's node: copy j-1's (layer 1's counterpart for j = 2)
NEXT = "next"        # the next layer's node: copy j+1's; the newest layer reads `fallback`


@dataclass(frozen=True)
class Read:
    kind: str
    name: str
    fallback: str = ""


@dataclass(frozen=True)
class Run:
    """Consecutive block nodes of the 3-layer graph, ``[start, stop)``."""

    start: int
    stop: int
    reversed: bool      # the layer-1 copy follows the run: layers appear newest first (backward)

    @property
    def twin(self) -> int:
        """Where the run's layer-1 copy starts."""
        return self.stop if self.reversed else 2 * self.start - self.stop

    def pairs(self, nodes: Sequence[Node]) -> dict[str, Node]:
        """Block node name -> its layer-1 copy."""
        return {nodes[self.start + i].name: nodes[self.twin + i] for i in range(self.stop - self.start)}


def _key(node: Node, module: str | None = None) -> tuple:
    """Everything but the name and the arguments' names; `module` overrides the provenance's."""
    meta = node.meta if module is None else tuple((k, module if k == "module" else v) for k, v in node.meta)
    return node.op, node.attrs, node.shape, node.dtype, meta, len(node.args)


def _new_names(old: Sequence[str], new: Sequence[str], what: str) -> list[str]:
    """Names of `new` not in `old`, which must be one contiguous group; the rest must be `old`, in order."""
    kept = set(old)
    extra = [i for i, name in enumerate(new) if name not in kept]
    if [name for name in new if name in kept] != list(old):
        raise CaptureError(f"layer block: the 3-layer capture's {what} do not contain the 2-layer capture's "
                           f"in the same order")
    if not extra or extra != list(range(extra[0], extra[0] + len(extra))):
        raise CaptureError(f"layer block: the 3-layer capture's new {what} {[new[i] for i in extra]} are not one "
                           f"contiguous group")
    return [new[i] for i in extra]


def _container(new_inputs: Sequence[str], old_inputs: set[str], new: int) -> str:
    """The module path holding the layers: every new input is ``<container>.<new>.<rest>`` and
    ``<container>.<new - 1>.<rest>`` is old."""
    found = None
    for name in new_inputs:
        here = {name[:m.start() - 1] for m in re.finditer(rf"(?<=\.){new}(?=\.)", name)
                if name[:m.start()] + str(new - 1) + name[m.end():] in old_inputs}
        found = here if found is None else found & here
    if not found or len(found) != 1:
        raise CaptureError(f"layer block: the 3-layer capture's new inputs {list(new_inputs)} are not the "
                           f"parameters <container>.{new}.* of one layer container")
    return found.pop()


class _Namer:
    """Layer index substitution in module paths, parameter and output names."""

    def __init__(self, container: str, new: int):
        self.container, self.new = container, new
        self.pattern = re.compile(rf"(^|/){re.escape(container)}\.{new}(?=\.|$)")

    def at(self, text: str, layer: int) -> str:
        return self.pattern.sub(rf"\g<1>{self.container}.{layer}", text) if layer != self.new else text

    def has(self, text: str) -> bool:
        return bool(self.pattern.search(text))

    def module_at(self, node: Node, layer: int) -> str:
        return self.at(node.get_meta("module", ""), layer)


def _align(two: Graph, three: Graph) -> tuple[dict[str, str], list[int]]:
    """Embed `two`'s nodes into `three`'s in order; the image map and the left-over positions of `three`."""
    image = {s.name: s.name for s in two.inputs}
    left: list[int] = []
    left_names: set[str] = set()
    nodes, j = three.nodes, 0
    for a in two.nodes:
        key = _key(a)
        while True:
            if j == len(nodes):
                raise CaptureError(f"layer block: node {describe(a)} of the 2-layer capture has no counterpart "
                                   f"in the 3-layer capture; the graph is not a layer block added to the 2-layer one")
            b = nodes[j]
            j += 1
            if _key(b) == key and all(image[x] == y or y in left_names for x, y in zip(a.args, b.args)):
                image[a.name] = b.name
                break
            left.append(j - 1)
            left_names.add(b.name)
    left.extend(range(j, len(nodes)))
    return image, left


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for i in positions:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(a, b) for a, b in runs]


@dataclass(frozen=True)
class LayerPattern:
    """What the third layer adds to a 2-layer graph, and how to repeat it (see the module docstring).

    Example::

        pattern = find_pattern(graph2, graph3)
        pattern.graph(3) == graph3
        deep = pattern.graph(126)
    """

    two: Graph
    three: Graph
    namer: _Namer
    runs: tuple[Run, ...]
    counterpart: Mapping[str, str]          # block node -> its layer-1 copy
    reads: Mapping[str, tuple[Read, ...]]   # block node -> how each argument is read
    new_inputs: tuple[str, ...]
    new_outputs: tuple[str, ...]

    @property
    def container(self) -> str:
        return self.namer.container

    def graph(self, layers: int) -> Graph:
        """The graph with `layers` layers (>= 2): copies of the block for layers 2..layers-1."""
        first = self.namer.new
        if layers < first:
            raise CaptureError(f"layer extrapolation starts from {first} layers, asked for {layers}")
        if layers == first:
            return self.two
        newest = layers - 1
        layer_one = set(self.counterpart.values())
        starts = {run.start: run for run in self.runs}
        nodes: list[Node] = []
        three, i = self.three.nodes, 0
        while i < len(three):
            run = starts.get(i)
            if run is None:
                nodes.append(self._context(three[i], newest, three[i].name in layer_one))
                i += 1
                continue
            order = range(newest, first - 1, -1) if run.reversed else range(first, newest + 1)
            for j in order:
                nodes.extend(self._copy(three[t], j, newest) for t in range(run.start, run.stop))
            i = run.stop
        graph = Graph(self._inputs(newest), tuple(nodes), self._outputs(newest), self.three.name)
        try:
            check_names(graph)
        except GraphError as err:
            raise CaptureError(f"layer extrapolation to {layers} layers built a malformed graph: {err}") from None
        return graph

    # -- the pieces of graph(k) ------------------------------------------------------------
    def _name(self, node: str, layer: int) -> str:
        return node if layer == self.namer.new else f"{node}_l{layer}"

    def _copy(self, node: Node, layer: int, newest: int) -> Node:
        args = []
        for read in self.reads[node.name]:
            if read.kind == OWN:
                args.append(self._name(read.name, layer))
            elif read.kind == PARAM:
                args.append(self.namer.at(read.name, layer))
            elif read.kind == SHARED:
                args.append(read.name)
            elif read.kind == PREV:
                args.append(self._name(read.name, layer - 1) if layer > self.namer.new else self.counterpart[read.name])
            else:
                args.append(self._name(read.name, layer + 1) if layer < newest else read.fallback)
        meta = tuple((k, self.namer.at(v, layer) if k == "module" else v) for k, v in node.meta)
        return Node(self._name(node.name, layer), node.op, tuple(args), node.attrs, node.shape, node.dtype, meta)

    def _context(self, node: Node, newest: int, in_layer_one: bool) -> Node:
        """A node outside the block: its reads of the block go to the first copy (from its twin layer) or to the
        newest layer."""
        if not any(a in self.reads for a in node.args):
            return node
        args = tuple(self._name(a, self.namer.new if in_layer_one else newest) if a in self.reads else a
                     for a in node.args)
        return Node(node.name, node.op, args, node.attrs, node.shape, node.dtype, node.meta)

    def _inputs(self, newest: int) -> tuple[TensorSpec, ...]:
        out: list[TensorSpec] = []
        for spec in self.three.inputs:
            if spec.name == self.new_inputs[0]:
                out += [replace(s, name=self.namer.at(s.name, j))
                        for j in range(self.namer.new, newest + 1) for s in self.three.inputs
                        if s.name in self.new_inputs]
            elif spec.name not in self.new_inputs:
                out.append(spec)
        return tuple(out)

    def _outputs(self, newest: int) -> tuple[tuple[str, str], ...]:
        out: list[tuple[str, str]] = []
        new = set(self.new_outputs)
        for name, value in self.three.outputs:
            if name == self.new_outputs[0]:
                out += [(self.namer.at(n, j), self._name(v, j) if v in self.reads else self.namer.at(v, j))
                        for j in range(self.namer.new, newest + 1) for n, v in self.three.outputs if n in new]
            elif name not in new:
                out.append((name, self._name(value, newest) if value in self.reads else value))
        return tuple(out)


def find_pattern(two: Graph, three: Graph, new: int = 2) -> LayerPattern:
    """The layer block of `three` (one layer more, layer `new`) relative to `two`; CaptureError if there is none."""
    new_inputs = _new_names([s.name for s in two.inputs], [s.name for s in three.inputs], "inputs")
    namer = _Namer(_container(new_inputs, {s.name for s in two.inputs}, new), new)
    old_specs = {s.name: s for s in two.inputs}
    for spec in three.inputs:
        if spec.name in old_specs and spec != old_specs[spec.name]:
            raise CaptureError(f"layer block: input {spec.name} differs between the 2- and 3-layer captures")
    new_outputs = _new_names([n for n, _ in two.outputs], [n for n, _ in three.outputs], "outputs")
    for name in new_outputs:
        if not namer.has(name):
            raise CaptureError(f"layer block: the 3-layer capture's new output {name} is not named after layer 2")

    image, left = _align(two, three)
    block = {three.nodes[i].name for i in left}
    runs = _layer_runs(three, _runs(left), block, namer)
    counterpart = {b: twin.name for r in runs for b, twin in r.pairs(three.nodes).items()}
    layer_one = {twin: b for b, twin in counterpart.items()}
    reads = {three.nodes[i].name: _reads(three.nodes[i], three, block, counterpart, layer_one, namer, set(new_inputs))
             for i in left}
    old_outputs = two.output_map
    for name, value in three.outputs:
        if name in old_outputs and value != image[old_outputs[name]] and value not in block:
            raise CaptureError(f"layer block: output {name} is {value} in the 3-layer capture, not the image of "
                               f"{old_outputs[name]} nor a node of the new layer")
        if name in new_outputs and value not in block and value not in new_inputs:
            raise CaptureError(f"layer block: layer 2's output {name} is {value}, which is not the layer's own")
    return LayerPattern(two, three, namer, tuple(runs), counterpart, reads, tuple(new_inputs), tuple(new_outputs))


def _layer_runs(three: Graph, spans: Sequence[tuple[int, int]], block: set[str], namer: _Namer) -> list[Run]:
    """Each run with the side its layer-1 copy is on: the one whose nodes and internal wiring match."""
    nodes = three.nodes

    def matches(run: Run) -> bool:
        if run.twin < 0 or run.twin + run.stop - run.start > len(nodes):
            return False
        return all(twin.name not in block and
                   _key(twin) == _key(three.value(b), namer.module_at(three.value(b), namer.new - 1))
                   for b, twin in run.pairs(nodes).items())

    options = []
    for start, stop in spans:
        sides = [run for run in (Run(start, stop, False), Run(start, stop, True)) if matches(run)]
        if not sides:
            raise CaptureError(f"layer block: the new nodes {nodes[start].name}..{nodes[stop - 1].name} are not "
                               f"next to a copy of themselves for layer 1 (before them as in a forward, or after "
                               f"them as in a backward)")
        options.append(sides)
    for choice in itertools.product(*options):
        pair = {b: twin for run in choice for b, twin in run.pairs(nodes).items()}
        if all(pair[a].name == pair[b].args[p] for b in pair for p, a in enumerate(three.value(b).args) if a in block):
            return list(choice)
    raise CaptureError("layer block: no placement of the layer-1 copies wires like the new layer does")


def _reads(node: Node, three: Graph, block: set[str], counterpart: Mapping[str, str], layer_one: Mapping[str, str],
           namer: _Namer, new_inputs: set[str]) -> tuple[Read, ...]:
    """How each argument of a block node is read, from what its layer-1 counterpart reads in its place."""
    twin = three.value(counterpart[node.name])
    reads = []
    for p, (arg, other) in enumerate(zip(node.args, twin.args)):
        if arg in block:
            read = Read(OWN, arg) if other == counterpart[arg] else None
        elif arg in new_inputs:
            read = Read(PARAM, arg) if other == namer.at(arg, namer.new - 1) else None
        elif arg == other:
            read = Read(SHARED, arg)
        elif arg in layer_one:
            read = Read(PREV, layer_one[arg])
        elif other in block:
            read = Read(NEXT, other, arg)
        else:
            read = None
        if read is None:
            raise CaptureError(f"layer block: {describe(node)} reads {arg} as argument {p} where its layer-1 copy "
                               f"{describe(twin)} reads {other}; that is not a value of its own layer, shared by "
                               f"all layers, nor the previous or next layer's")
        reads.append(read)
    return tuple(reads)


# -- the check -------------------------------------------------------------------------------------
def first_difference(made: Graph, real: Graph) -> str | None:
    """Where `made` first differs from `real`, comparing node by node with names mapped; None if nowhere."""
    for i, (x, y) in enumerate(itertools.zip_longest(made.inputs, real.inputs)):
        if x != y:
            return f"input {i}: {x} in the extrapolation, {y} in the capture"
    def fields(node: Node, args: tuple[str, ...]) -> tuple:
        return (("op", node.op), ("attributes", node.attrs), ("shape", node.shape), ("dtype", node.dtype),
                ("provenance", node.meta), ("arguments", args))

    rename = {s.name: s.name for s in made.inputs}
    for i, (x, y) in enumerate(zip(made.nodes, real.nodes)):
        mapped = tuple(rename.get(a, f"<undefined {a}>") for a in x.args)
        for (what, a), (_, b) in zip(fields(x, mapped), fields(y, y.args)):
            if a != b:
                return f"node {i}: {describe(x)} in the extrapolation, {describe(y)} in the capture ({what}: {a} vs {b})"
        rename[x.name] = y.name
    if len(made.nodes) != len(real.nodes):
        return f"the extrapolation has {len(made.nodes)} nodes, the capture {len(real.nodes)}"
    mapped = tuple((n, rename[v]) for n, v in made.outputs)
    if mapped != real.outputs:
        out = next((a, b) for a, b in itertools.zip_longest(mapped, real.outputs) if a != b)
        return f"outputs: {out[0]} in the extrapolation, {out[1]} in the capture"
    return None


def extrapolate(graphs: Mapping[int, Graph], layers: int, model: str) -> Graph:
    """The `layers`-layer graph from the captures at b, b + 1 and b + 2 layers (`probe_layers`; b = 2 unless the
    first layers differ, as DeepSeek-V3's dense ones), checked on the deepest.

    Example::

        deep = extrapolate({k: capture(spec.with_dims(layers=k)) for k in (2, 3, 4)}, 126, spec.name)
    """
    advice = (f"the layers of {model} do not repeat exactly; capture it layer by layer with "
              f"capture(spec, extrapolate=False) (slower: every layer is traced)")
    first = min(graphs)
    try:
        pattern = find_pattern(graphs[first], graphs[first + 1], new=first)
    except CaptureError as err:
        raise CaptureError(f"capture({model}, layers={layers}): layer extrapolation refused — {err}; "
                           f"{advice}") from None
    difference = first_difference(pattern.graph(first + 2), graphs[first + 2])
    if difference is not None:
        raise CaptureError(f"capture({model}, layers={layers}): layer extrapolation refused — the layer block of "
                           f"the 2- and 3-layer captures, repeated to 4 layers, differs from the 4-layer capture at "
                           f"{difference}; {advice}")
    return pattern.graph(layers)
