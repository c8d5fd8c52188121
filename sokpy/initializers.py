"""Initial values of embedding rows: a pure function of (seed, global key, column).

Each initializer is computed by the ``init_rows`` kernel from a counter-based generator, so
the same seed gives the same table on 1 rank and on 4, on the host and on the device.

Example::

    import sokpy
    init = sokpy.initializers.uniform(-0.05, 0.05)   # also normal(0, 0.01), constant(0.5),
                                                      # zeros(), ones(); a bare float = constant
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Initializer", "constant", "zeros", "ones", "uniform", "normal", "resolve"]

_KINDS = {"constant": 0, "uniform": 1, "normal": 2}


@dataclass(frozen=True)
class Initializer:
    """``kind`` is "constant" (value a), "uniform" ([a, b)) or "normal" (mean a, std b)."""

    kind: str
    a: float
    b: float = 0.0

    @property
    def code(self) -> int:
        return _KINDS[self.kind]


def constant(value: float) -> Initializer:
    return Initializer("constant", float(value))


def zeros() -> Initializer:
    return constant(0.0)


def ones() -> Initializer:
    return constant(1.0)


def uniform(low: float = -0.05, high: float = 0.05) -> Initializer:
    if not high >= low:
        raise ValueError(f"uniform initializer: high ({high}) must be >= low ({low})")
    return Initializer("uniform", float(low), float(high))


def normal(mean: float = 0.0, std: float = 1.0) -> Initializer:
    if not std >= 0:
        raise ValueError(f"normal initializer: std must be >= 0, got {std}")
    return Initializer("normal", float(mean), float(std))


def resolve(init) -> Initializer:
    """``None`` -> the default uniform(-0.05, 0.05); a number -> constant; else as given."""
    if init is None:
        return uniform(-0.05, 0.05)
    if isinstance(init, Initializer):
        return init
    if isinstance(init, (int, float)):
        return constant(init)
    raise TypeError(f"initializer must be a sokpy.initializers.Initializer or a number, not {type(init).__name__}")
