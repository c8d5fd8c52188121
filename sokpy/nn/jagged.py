"""Jagged inputs and outputs of the torch modules: KeyedJaggedTensor in, JaggedTensor out.

TorchRec's own types are used when torchrec imports; without it (not installed, or installed
and failing to import, whatever the error), sokpy's :class:`KeyedJaggedTensor` and
:class:`JaggedTensor` (:mod:`sokpy.nn.kjt`, TorchRec's constructors and methods) take their
place, and a TorchRec object given as input is refused with the import's error.
:func:`module_batch` turns a module's input (a KeyedJaggedTensor, TorchRec's or ours, or a
dict feature -> ids, where ids is anything ``lookup_sparse`` takes for one table, a
``(values, offsets)`` pair or a ``(values, offsets, weights)`` triple) into the one batch
its lookup call takes (:mod:`sokpy.inputs`), which the module reads again for its outputs.

Example::

    import torch
    from sokpy.nn import KeyedJaggedTensor
    # 2 samples; "user": [1], []; "item": [7], [8]
    kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 7, 8]), lengths=torch.tensor([1, 0, 1, 1]))
    assert kjt.keys() == ["user", "item"] and kjt.stride() == 2
"""

from __future__ import annotations

from typing import Any

from ..exchange.batch import BatchError
from ..inputs.features import features_batch
from .kjt import JaggedTensor, KeyedJaggedTensor

__all__ = ["KeyedJaggedTensor", "JaggedTensor", "module_batch", "torchrec_types", "torchrec_import_error"]

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


def _refuse_broken_torchrec(x: object) -> None:
    """Refuses a TorchRec object when TorchRec itself does not import here."""
    error = torchrec_import_error()
    if error is not None and type(x).__module__.split(".")[0] == "torchrec":
        raise TypeError(
            f"the input is TorchRec's {type(x).__name__}, but torchrec does not import here ({error}); "
            "use sokpy.nn.KeyedJaggedTensor or a dict, or install the TorchRec that pairs with this torch"
        )


def module_batch(features, weights, names: list[str], tables: list, module: str, weighted: bool):
    """``(batch, None)`` of a module's input (:func:`sokpy.inputs.features_batch`: a
    KeyedJaggedTensor, TorchRec's or ours, parsed once, or a dict feature -> ids) for its
    features ``names`` (read by ``tables``), or ``(None, the fault's text)``: the lookup
    raises it on every rank alike."""
    try:
        _refuse_broken_torchrec(features)
        return features_batch(features, weights, names, module, weighted), None
    except BatchError as e:
        return None, e.named(tables)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it, in the lookup's agreement
        text = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        return None, f"{module} input: {text}"
