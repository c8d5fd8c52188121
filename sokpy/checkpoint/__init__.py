"""Checkpoints: ``save`` and ``load`` tables and optimizer state, at any world size, atomically.

The package's parts, one concern each:

* :mod:`sokpy.checkpoint.format`: the folder on disk: its file names, the manifest and its
  entries, ``.npy`` files written with their CRC-32 and read back checked; and
  :func:`read_table`, which needs no sokpy runtime;
* :mod:`sokpy.checkpoint.staging`: a save's staging folder (and those killed saves left), and
  the verdict of a checkpoint call (:func:`~sokpy.checkpoint.staging.agree`);
* :mod:`sokpy.checkpoint.saving`: :func:`save`, atomic;
* :mod:`sokpy.checkpoint.loading`: :func:`load`, at any world size, every check before any change;
* :mod:`sokpy.checkpoint.state`: :func:`gather_state` / :func:`load_state`, whole tables in
  memory (what :meth:`sokpy.nn.EmbeddingBagCollection.state_dict` holds).

Example::

    import sokpy
    sokpy.init()
    v = sokpy.Variable(100, 8, name="ckpt_user")
    opt = sokpy.optim.Adagrad([v], lr=0.1)
    sokpy.save("ckpt", [v], optimizer=opt)   # a folder every rank sees (a shared file system)
    sokpy.load("ckpt", [v], optimizer=opt)   # also at another number of ranks
"""

from .format import FORMAT, VERSION, read_table
from .loading import load
from .saving import save

# Not in __all__: sokpy.nn's state_dict code uses them as sokpy.checkpoint.<name>.
from .state import STATE_FORMAT as STATE_FORMAT
from .state import float32_values as float32_values
from .state import gather_state as gather_state
from .state import load_state as load_state
from .state import values_tensor as values_tensor

__all__ = ["save", "load", "FORMAT", "VERSION", "read_table"]
