"""Atoms: the typed name of a variable that stands for one element of a tensor.

    >>> a = Atom("tokens", (0, 1))
    >>> str(a), str(a.indicator(2, 4)), a.indicator(2, 4).element
    ('tokens[0,1]', 'onehot:tokens[0,1]=2/4', Atom(base='tokens', idx=(0, 1), onehot=None))

`base` says whose element it is: a logical tensor's name (a str), or a typed
value whose ``str`` names it — a free part of a partial sum, an opaque op's
value (`tv_ray.partition.ids`). `onehot` makes it the indicator
δ(element = v) of an integer data element in [0, n) (`tv_ray.terms.onehot`).
The text form (``str``) is what hashes, solvers and reports see; code reads
and renames the fields, never the text.
"""
from __future__ import annotations

from typing import Hashable, NamedTuple


class Atom(NamedTuple):
    base: Hashable
    idx: tuple[int, ...]
    onehot: tuple[int, int] | None = None      # (v, n): the indicator of the value v of an element in [0, n)

    def __str__(self) -> str:
        text = f"{self.base}[{','.join(map(str, self.idx))}]"
        return text if self.onehot is None else f"onehot:{text}={self.onehot[0]}/{self.onehot[1]}"

    @property
    def element(self) -> "Atom":
        """The element an indicator is about (itself for any other atom)."""
        return self if self.onehot is None else Atom(self.base, self.idx)

    def indicator(self, v: int, n: int) -> "Atom":
        """The indicator δ(self = v) of this integer element with range [0, n)."""
        return Atom(self.base, self.idx, (v, n))


def text_key(name) -> str:
    """Sort key for variable names of either form (a str or an Atom): their text."""
    return str(name)


__all__ = ["Atom", "text_key"]
