"""The parallel spec: ``dp=2,tp=2,pp=2,mb=2`` plus flags, and the checks that refuse impossible configs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tv_ray.errors import ParallelConfigError

DEGREES = ("dp", "tp", "pp", "mb", "cp", "ep")


@dataclass(frozen=True)
class ParallelSpec:
    """How to distribute one training step.

    ``ep`` is carved out of ``dp`` as Megatron does: ``dp=4,ep=2`` is 4 data-parallel ranks whose routed
    experts are split over 2 (each expert held by ``edp`` = 2 of them); the plan's mesh names the axes
    ``dp`` (of size edp) and ``ep``, and the data-parallel group of every other weight is dp × ep.

    Example::

        ParallelSpec.parse("dp=2,tp=2,pp=2,mb=2", sp=True, zero=1)
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    mb: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    zero: int = 0

    @staticmethod
    def parse(text: str, **flags) -> "ParallelSpec":
        values: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in DEGREES:
                raise ParallelConfigError(f"parallel spec {text!r}: {item!r} is not one of "
                                          f"{', '.join(d + '=N' for d in DEGREES)}")
            if key in values:
                raise ParallelConfigError(f"parallel spec {text!r}: {key} given twice")
            try:
                values[key] = int(value)
            except ValueError:
                raise ParallelConfigError(f"parallel spec {text!r}: {key}={value!r} is not an integer") from None
            if values[key] < 1:
                raise ParallelConfigError(f"parallel spec {text!r}: {key} must be >= 1, got {values[key]}")
        spec = ParallelSpec(**values, **flags)
        spec.check_flags()
        return spec

    def check_flags(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ParallelConfigError(f"--zero {self.zero}: ZeRO stage must be 0, 1, 2 or 3")
        if self.sp and self.tp == 1:
            raise ParallelConfigError("--sp (sequence parallel) needs tp > 1: it shards the sequence over tp")
        if self.dp % self.ep:
            raise ParallelConfigError(f"ep = {self.ep} must divide dp = {self.dp}: expert parallelism is carved "
                                      f"out of the data-parallel ranks")

    def __str__(self) -> str:
        text = ",".join(f"{d}={getattr(self, d)}" for d in DEGREES if getattr(self, d) != 1) or "dp=1"
        return text + (",sp" if self.sp else "") + (f",zero={self.zero}" if self.zero else "")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def edp(self) -> int:
        """The expert-data-parallel degree: how many data-parallel ranks hold a copy of each expert."""
        return self.dp // self.ep

    def check_model(self, dims: Mapping[str, int], layers: int | None) -> None:
        """Refuse configs the model cannot take, naming the failing constraint."""
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ParallelConfigError(f"parallel spec {self}: {message}")
        batch = dims.get("batch")
        if batch is not None:
            need(batch % (self.dp * self.mb) == 0,
                 f"dp*mb = {self.dp * self.mb} must divide batch = {batch}")
        for name in ("kv_heads", "heads", "ffn", "moe_ffn", "vocab"):
            if name in dims and self.tp > 1:
                need(dims[name] % self.tp == 0, f"tp = {self.tp} must divide {name} = {dims[name]}")
        if self.ep > 1:
            need("experts" in dims, "ep > 1 needs a model with routed experts (a MoE model)")
            need(dims["experts"] % self.ep == 0, f"ep = {self.ep} must divide experts = {dims['experts']}")
        if self.sp and "seq" in dims:
            need(dims["seq"] % (self.cp * self.tp) == 0,
                 f"sequence parallel: cp*tp = {self.cp * self.tp} must divide seq = {dims['seq']}")
        if self.cp > 1:
            need("seq" in dims and dims["seq"] % self.cp == 0,
                 f"cp = {self.cp} must divide seq = {dims.get('seq', 'none: the model has no sequence')}")
        if layers is not None:
            need(self.pp <= layers, f"pp = {self.pp} is more than the model's {layers} layers")

