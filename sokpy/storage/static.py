"""A static table's shard: a fixed number of rows; the stored row of a key follows from the
placement rule (``k // W`` or ``k``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import kernels, runtime
from .rows import InitSpec, Storage, init_rows


class StaticStorage(Storage):
    """A static table's shard: ``rows`` local rows; key ``k`` is stored at row ``k // W`` on
    rank ``k % W`` (distributed) or at row ``k`` on its one rank (localized)."""

    def __init__(
        self,
        local_rows: int,
        dim: int,
        init: InitSpec,
        key_stride: int,
        key_base: int,
        localized: bool,
        dtype: str = "float32",
        rounding: str = "stochastic",
    ) -> None:
        super().__init__(dim, init, dtype, rounding)
        c = kernels.constants()
        self.kind = c["SOKPY_KIND_STATIC_AT"] if localized else c["SOKPY_KIND_STATIC"]
        self.key_stride, self.key_base = int(key_stride), int(key_base)
        self.data = runtime.empty_rows((int(local_rows), self.value_cols), np.float32)
        init_rows([(self, 0, self.size)])

    @property
    def size(self) -> int:
        return int(self.data.shape[0])

    def keys(self, start: int = 0, stop: int | None = None) -> Any:
        xp = runtime.xp()
        stop = self.size if stop is None else stop
        return xp.arange(start, stop, dtype=np.int64) * self.key_stride + self.key_base

    def find(self, keys: Any, insert: bool) -> Any:
        return (keys - self.key_base) // self.key_stride

    def new_like(self) -> StaticStorage:
        s = object.__new__(StaticStorage)
        Storage.__init__(s, self.dim, self.init, self.dtype, self.rounding)
        s.kind, s.key_stride, s.key_base = self.kind, self.key_stride, self.key_base
        s.slot_names, s.slot_init, s.slot_per_row = list(self.slot_names), list(self.slot_init), list(self.slot_per_row)
        s.data = runtime.empty_rows(self.data.shape, np.float32)
        return s
