"""Table storage: a table's rows and its optimizer state on this rank, behind one interface.

Every table shard is a buffer of stored rows ``data [capacity, width]``: each row holds the
embedding values, then one column block per optimizer slot, so optimizer state lives beside
its row and is gathered, scattered, grown and saved with it. Only this package knows where a
slot's columns are and how 16-bit values pack (:mod:`sokpy.storage.rows` says how).

The package's parts, one concern each:

* :mod:`sokpy.storage.rows`: :class:`Storage`, what every shard provides: the row layout
  (values, optimizer slots, half-precision rows), the kernels' view of a shard (its
  descriptor), :class:`InitSpec` and :func:`init_rows` (how new rows start), and the
  buffers' :func:`epoch`;
* :mod:`sokpy.storage.static`: :class:`StaticStorage`, a fixed number of rows; the stored row
  of a key follows from the placement rule (``k // W`` or ``k``);
* :mod:`sokpy.storage.hashed`: :class:`HashStorage`, a dynamic table's shard. An
  open-addressing hash index (a key word and a state word per slot, linear probing, load at
  most 1/2) maps any int64 key to a row of a dense row store, numbered in order of insertion.
  Rows never move: growing the index re-inserts keys only (``rehash_index``), growing the row
  store copies the rows once;
* :mod:`sokpy.storage.eviction`: a capped HashStorage's scores and eviction
  (:class:`~sokpy.storage.eviction.CappedShard`, a base class of HashStorage);
* :mod:`sokpy.storage.room`: one call's inserts across shards: :func:`plan_room` and
  :class:`Room` (what each capped shard's step needs), :func:`finish_inserts`.

Lookup, the optimizers and checkpoints use only this interface plus the table descriptor
the kernels read (:meth:`Storage.descriptor`): neither knows which kind of table it touches.

Example::

    import sokpy
    from sokpy.storage import HashStorage, InitSpec
    sokpy.init()
    s = HashStorage(dim=4, init=InitSpec(0, 0.0, 0.0, 0), capacity=8)   # rows start at 0
    s.reserve(100)                     # room for 100 new keys: the index and row store grow
    print(s.size, s.capacity >= 100)
"""

from .hashed import HashStorage
from .room import Room, finish_inserts, plan_room
from .rows import DTYPES, ROUNDINGS, InitSpec, Storage, check_format, epoch, init_rows, new_epoch
from .static import StaticStorage

__all__ = [
    "Storage",
    "StaticStorage",
    "HashStorage",
    "InitSpec",
    "Room",
    "epoch",
    "new_epoch",
    "init_rows",
    "finish_inserts",
    "plan_room",
    "DTYPES",
    "ROUNDINGS",
    "check_format",
]
