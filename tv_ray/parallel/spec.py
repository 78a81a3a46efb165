"""The parallel spec: ``dp=2,tp=2,pp=2,mb=2`` plus flags, and the checks that refuse impossible configs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tv_ray.errors import ParallelConfigError

DEGREES = ("dp", "tp", "pp", "mb", "cp", "ep")


@dataclass(frozen=True)
class ParallelSpec:
    """How to distribute one training step.

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
        if self.cp > 1 or self.ep > 1:
            raise ParallelConfigError("cp and ep: the plan format expresses them, but the built-in "
                                      "recipe does not build them yet; write the plan by hand")

    def __str__(self) -> str:
        text = ",".join(f"{d}={getattr(self, d)}" for d in DEGREES if getattr(self, d) != 1) or "dp=1"
        return text + (",sp" if self.sp else "") + (f",zero={self.zero}" if self.zero else "")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    def check_model(self, dims: Mapping[str, int], layers: int | None) -> None:
        """Refuse configs the model cannot take, naming the failing constraint."""
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ParallelConfigError(f"parallel spec {self}: {message}")
        batch = dims.get("batch")
        if batch is not None:
            need(batch % (self.dp * self.mb) == 0,
                 f"dp*mb = {self.dp * self.mb} must divide batch = {batch}")
        for name in ("kv_heads", "heads", "ffn", "vocab"):
            if name in dims and self.tp > 1:
                need(dims[name] % self.tp == 0, f"tp = {self.tp} must divide {name} = {dims[name]}")
        if self.sp and "seq" in dims:
            need(dims["seq"] % self.tp == 0, f"sequence parallel: tp = {self.tp} must divide seq = {dims['seq']}")
        if layers is not None:
            need(self.pp <= layers, f"pp = {self.pp} is more than the model's {layers} layers")

