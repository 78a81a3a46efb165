"""ModelSpec: a built-in model family at one configuration of named dimensions.

A spec knows the model's named dims and their full values, builds the torch
module at any dims table (on the meta device for frontier sizes, on the CPU
for numbers), makes example inputs, and proposes the small *probe* tables the
capture fits shape expressions from.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from tv_ray.errors import TvRayError

# Probe tables: every dim a distinct odd prime (head-like dims that must be even
# get twice a prime). Table B uses primes disjoint from table A's, so the ratio
# of a value between A and B factors uniquely into dim exponents; table C is a
# permutation of A's primes and only checks the fit.
_ODD_PRIMES = (3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97,
               101, 103, 107, 109)


def probe_tables(dim_names: tuple[str, ...], even: tuple[str, ...] = (),
                 at_least: Mapping[str, int] | None = None) -> tuple[dict[str, int], ...]:
    """Three small dims tables, every dim >= 3 (or 6 if even) and distinct within a table; a dim named in
    `at_least` trades its value with the table's largest where it would fall below its bound (a top-k's
    experts), which keeps every property above."""
    n = len(dim_names)
    if 2 * n > len(_ODD_PRIMES):
        raise TvRayError(f"probe_tables: {n} dims need {2 * n} distinct primes; extend _ODD_PRIMES")
    a_primes, b_primes = _ODD_PRIMES[:n], _ODD_PRIMES[n:2 * n]
    c_primes = a_primes[1:] + a_primes[:1]

    def table(primes):
        primes = list(primes)
        for d, low in (at_least or {}).items():
            i = dim_names.index(d)
            if primes[i] * (2 if d in even else 1) < low:
                j = max(range(n), key=primes.__getitem__)
                primes[i], primes[j] = primes[j], primes[i]
                if primes[i] * (2 if d in even else 1) < low:
                    raise TvRayError(f"probe_tables: no probe value of {d} reaches {low}; extend _ODD_PRIMES")
        return {d: p * (2 if d in even else 1) for d, p in zip(dim_names, primes)}

    return table(a_primes), table(b_primes), table(c_primes)


@dataclass(frozen=True)
class ModelSpec:
    """A named model: its config (a dataclass whose DIMS fields are named dims) and how to build it.

    Example::

        spec = tv_ray.models.get("llama3-tiny")
        module = spec.build(device="cpu", dtype=torch.float64)
        tokens, targets = spec.example_inputs()
        loss = module(tokens, targets)
    """

    name: str
    config: Any                                  # LlamaConfig, GPT2Config, ...
    make_module: Callable[[Any], torch.nn.Module]
    description: str = ""

    # -- dims ----------------------------------------------------------------
    @property
    def dim_names(self) -> tuple[str, ...]:
        return type(self.config).DIMS

    @property
    def dims(self) -> dict[str, int]:
        """The full value of every named dim."""
        return {d: getattr(self.config, d) for d in self.dim_names}

    def with_dims(self, dims: Mapping[str, int] | None = None, **options: Any) -> "ModelSpec":
        """The same model at other dims (a full table) and/or options (layers, tied, ...)."""
        changes = dict(options)
        if dims is not None:
            missing = set(self.dim_names) - set(dims)
            unknown = set(dims) - set(self.dim_names)
            if missing or unknown:
                raise TvRayError(f"model {self.name}: dims table must define exactly {list(self.dim_names)}; "
                                 f"missing {sorted(missing)}, unknown {sorted(unknown)}")
            changes.update(dims)
        try:
            config = dataclasses.replace(self.config, **changes)
        except TypeError as err:
            raise TvRayError(f"model {self.name}: {err}; fields are "
                             f"{[f.name for f in dataclasses.fields(self.config)]}") from None
        return dataclasses.replace(self, config=config)

    def probe_dims(self) -> tuple[dict[str, int], ...]:
        """Three small dims tables at which the capture fits shape expressions."""
        return probe_tables(self.dim_names, getattr(type(self.config), "EVEN_DIMS", ()),
                            getattr(self.config, "min_dims", None))

    # -- torch -----------------------------------------------------------------
    def build(self, dims: Mapping[str, int] | None = None, device: str | torch.device = "meta",
              dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
        """The torch module at `dims` (default: the full dims) with torch's default init."""
        spec = self.with_dims(dims) if dims is not None else self
        torch.manual_seed(seed)
        with torch.device(device):
            module = self.make_module(spec.config)
        # modules are built in float32; converting a fake-tensor module in place is not allowed
        return module if dtype == torch.float32 else module.to(dtype)

    def example_inputs(self, dims: Mapping[str, int] | None = None, device: str | torch.device = "cpu",
                       seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Random (tokens, targets), both int64 of shape (batch, seq) with values in [0, vocab)."""
        d = dict(self.dims if dims is None else dims)
        gen = torch.Generator().manual_seed(seed)
        shape = (d["batch"], d["seq"])
        tokens = torch.randint(0, d["vocab"], shape, generator=gen)
        targets = torch.randint(0, d["vocab"], shape, generator=gen)
        return tokens.to(device), targets.to(device)

    def param_count(self) -> int:
        """Number of parameters at the full dims (built on the meta device, nothing allocated)."""
        return sum(p.numel() for p in self.build(device="meta").parameters())
