"""Input types for ``lookup_sparse``, and their conversion to one batch for all tables.

:class:`Ragged` is the native form: ``values`` (the keys of all bags, one after another),
``offsets`` (int64, length B+1: bag b is ``values[offsets[b]:offsets[b+1]]``) and optional
per-key ``weights``. ``lookup_sparse`` also takes, per table:

* a torch sparse COO tensor ``[B, H]`` (TensorFlow's / SOK's SparseTensor shape): row i of
  the indices is the bag, the values are the keys; weights are a COO tensor of the same indices;
* a torch sparse CSR tensor ``[B, H]``: ``crow_indices`` are the offsets, ``values`` the keys;
* a 2-D integer tensor ``[B, H]``: B bags of exactly H keys (``nn.EmbeddingBag``'s 2-D input),
  or a 1-D one ``[B]``: one key per bag (a one-hot feature);
* a list of lists of ints, one list per bag;

and, for all tables at once, a KeyedJaggedTensor (TorchRec's, or any object with ``values()``,
``offsets()`` or ``lengths()``, ``weights_or_none()`` and ``stride()``), feature f feeding
table f.

:func:`to_batch` concatenates the tables' inputs into one :class:`Batch` (keys table after
table, bag offsets over all tables), which the lookup plan works on in one pass whatever the
number of tables. The wrappers only hold data: every check (integer keys, monotone offsets,
weights shaped like the bags) happens inside the collective call, where all ranks agree on
the verdict.

The package's parts, one concern each (this module holds :func:`to_batch`, which picks the path):

* :mod:`sokpy.exchange.sparse.batch`: :class:`Ragged`, :class:`Batch` and :class:`BatchError`, the
  faults a device parse records (``DeviceFaults``), and the array helpers every format uses;
* :mod:`sokpy.exchange.sparse.host_inputs`: the per-table formats on the host (``table_input``) and
  their concatenation into one batch;
* :mod:`sokpy.exchange.sparse.keyed_jagged`: a KeyedJaggedTensor for all tables (``kjt_stride``: its
  one batch size) on the host;
* :mod:`sokpy.exchange.sparse.device_inputs`: ids that arrived on the device, parsed there, and
  ``raise_fault``, which names what the device found.

Example::

    import torch, sokpy
    ids = sokpy.Ragged(values=torch.tensor([3, 1, 4, 1]), offsets=torch.tensor([0, 2, 2, 4]))
    # three bags: [3, 1], [], [4, 1]
"""

from __future__ import annotations

# The names imported "as" themselves are not in __all__, as before the split: sokpy's own
# modules import them from here (plan, nn.modules, nn.jagged).
from ...backends import runtime
from .batch import N_FAULTS as N_FAULTS
from .batch import Batch, BatchError, Ragged, one_bag_per_key
from .batch import DeviceFaults as DeviceFaults
from .batch import int_array as int_array
from .batch import segment_starts as segment_starts
from .device_inputs import device_keyed_jagged, device_tables, ids_on_device
from .device_inputs import raise_fault as raise_fault
from .host_inputs import host_tables
from .host_inputs import table_input as table_input
from .keyed_jagged import from_keyed_jagged, is_keyed_jagged
from .keyed_jagged import kjt_fault as kjt_fault
from .keyed_jagged import kjt_stride as kjt_stride

__all__ = ["Ragged", "Batch", "to_batch", "one_bag_per_key", "BatchError"]


def to_batch(sp_ids, sp_weights, ntables: int) -> Batch:
    """Converts and checks one call's input (``sp_ids``: one input per table, or one
    KeyedJaggedTensor for all); raises :class:`BatchError` naming the table on a fault.
    Ids that live on the backend's device (``cuda`` tensors on a GPU) stay there: they are
    parsed and checked by the device, which writes what it found into ``Batch.faults``."""
    be = runtime.current()
    on_device = ids_on_device(sp_ids, sp_weights, be)
    if is_keyed_jagged(sp_ids):
        if sp_weights is not None:
            raise BatchError(0, "a KeyedJaggedTensor carries its own weights; pass sp_weights=None")
        return device_keyed_jagged(sp_ids, ntables, be) if on_device else from_keyed_jagged(sp_ids, ntables)
    if not isinstance(sp_ids, (list, tuple)):
        raise BatchError(0, f"sp_ids must be a list with one input per table, got {type(sp_ids).__name__}")
    if len(sp_ids) != ntables:
        raise BatchError(0, f"sp_ids has {len(sp_ids)} entries but there are {ntables} tables")
    if sp_weights is None:
        sp_weights = [None] * ntables
    elif not isinstance(sp_weights, (list, tuple)) or len(sp_weights) != ntables:
        raise BatchError(0, f"sp_weights must be None or a list with one entry per table ({ntables})")
    if on_device:
        return device_tables(sp_ids, sp_weights, ntables, be)
    return host_tables(sp_ids, sp_weights, ntables)
