"""The inputs of a lookup, parsed where they live into one :class:`~sokpy.inputs.record.Batch`.

``lookup_sparse`` takes per table a :class:`Ragged` (``values``, int64 ``offsets`` of length
B+1, optional per-key ``weights``), a torch sparse COO ``[B, H]`` or CSR tensor, a 1-D ``[B]``
or 2-D ``[B, H]`` integer tensor, or a list of lists; or one KeyedJaggedTensor for all
tables. :mod:`~sokpy.inputs.forms` holds one adapter per form, :mod:`~sokpy.inputs.batch`
joins them and checks their values, on the host and on the device alike;
:mod:`~sokpy.inputs.features` makes the batch of a ``sokpy.nn`` module's features. A parse
reaches the backend only through the call's
:class:`~sokpy.backends.context.StageContext` (the record the plan's stages take), which
its :class:`~sokpy.inputs.forms.Place` holds.

Example::

    import torch, sokpy
    ids = sokpy.Ragged(values=torch.tensor([3, 1, 4, 1]), offsets=torch.tensor([0, 2, 2, 4]))
    # three bags: [3, 1], [], [4, 1]
"""

from .batch import to_batch
from .features import feature_ids, feature_offsets, features_batch
from .forms import Ragged, host_ragged, is_keyed_jagged
from .record import Batch, BatchError

__all__ = ["Ragged", "Batch", "BatchError", "to_batch", "features_batch"]
__all__ += ["feature_offsets", "feature_ids", "is_keyed_jagged", "host_ragged"]
