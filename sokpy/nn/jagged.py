"""Jagged inputs and outputs of the torch modules: KeyedJaggedTensor in, JaggedTensor out.

TorchRec's own types are used when torchrec imports; without it (not installed, or installed
and failing to import, whatever the error), sokpy's :class:`KeyedJaggedTensor` and
:class:`JaggedTensor` (:mod:`sokpy.nn.kjt`, TorchRec's constructors and methods) take their
place, and a TorchRec object given as input is refused with the import's error.
A module's input (a KeyedJaggedTensor, TorchRec's or ours, or a dict feature -> ids) is
parsed by :func:`sokpy.inputs.features.module_batch`, into the one batch its lookup call takes.

Example::

    import torch
    from sokpy.nn import KeyedJaggedTensor
    # 2 samples; "user": [1], []; "item": [7], [8]
    kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 7, 8]), lengths=torch.tensor([1, 0, 1, 1]))
    assert kjt.keys() == ["user", "item"] and kjt.stride() == 2
"""

from __future__ import annotations

from typing import Any

from .kjt import JaggedTensor, KeyedJaggedTensor

__all__ = ["KeyedJaggedTensor", "JaggedTensor", "torchrec_types", "torchrec_import_error"]

_TORCHREC: list[Any] = []  # [TorchRec's sparse types module or None, the import's error or None], once tried


def torchrec_types():
    """TorchRec's sparse types module, or None when torchrec does not import (not installed,
    or failing with any error: see :func:`torchrec_import_error`). Tried once per process."""
    if not _TORCHREC:
        try:
            from torchrec.sparse import jagged_tensor  # optional dependency (the torchrec extra)
        except ImportError:
            _TORCHREC[:] = [None, None]
        except Exception as e:  # noqa: BLE001 - installed but broken (an OSError of FBGEMM's library, say)
            _TORCHREC[:] = [None, f"{type(e).__name__}: {e}"]
        else:
            _TORCHREC[:] = [jagged_tensor, None]
    return _TORCHREC[0]


def torchrec_import_error() -> str | None:
    """Why an installed torchrec did not import (None: it imported, or is not installed)."""
    torchrec_types()
    return _TORCHREC[1]
