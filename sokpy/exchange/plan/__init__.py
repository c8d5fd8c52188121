"""The exchange plan of one ``lookup_sparse`` call, for all its tables at once.

A call's host work and kernel launches do not grow with its number of tables: the tables are
described by two small arrays (``cuda_src/sokpy_tables.cuh``), the keys of all tables lie in
one array, and every phase is one kernel launch or one array operation over all of them.

Forward (``LookupPlan.forward``):

1. ``route_keys``: for every key, its owner, a range check and a packed sort value
   ``(owner, table, row-or-hash, position)``; one sort of those values groups the keys by
   owner and table and finds the unique ones (positions of equal keys stay in order);
2. the collective header (``collective.Call.agree``) carries each rank's verdict, its key
   counts per peer and the row elements it expects back from each: the one count exchange a
   lookup needs anyway (the host's one read from the device comes before it);
3. one all-to-all of keys for all tables (each peer's message starts with its per-table
   counts; the deduplication's kernels write it: ``group_unique_counts`` the counts, which
   the host reads with the verdict, ``unique_key_heads`` the keys), then on the owner
   ``received_keys`` (the layout of what arrived, from one copy of the call's small host
   arrays), ``find_rows`` (placement arithmetic or hash find-or-insert) and ``gather_rows``
   into one buffer;
4. one all-to-all of rows back; ``expand_segments`` gives each key its row's offset, and
   ``combine_forward`` pools every bag of every table.

On one rank there is nothing to exchange: ``find_rows`` runs on the keys of dynamic tables
(a static table's key is its stored row there) and the pooling reads the tables' own rows.
Backward is the transpose: ``segment_sum`` (one gradient row per unique key, in a fixed
order, no float atomics; a hot key's positions as a tree of pieces, whose nodes
``segment_piece_sums`` sums in parallel first with the device's launch shapes), the same
exchange in reverse, and the owners merge what arrives (``owner_grad_entries`` lays out the
entries and their sort values, one sort, ``grad_row_heads`` numbers the unique rows,
``merge_grads`` sums them) and keep the buffer as a
:class:`~sokpy.exchange.gradients.GradChunk`.

Buffers exchanged between two ranks hold, per peer, a block of ``ntables`` leading slots
(the per-table key counts in the key message; in the backward, whether each table's output
received a gradient on the sender) followed by the rows, table after table. In the buffers
of rows (forward and backward) the leading slots are padded to whole cache lines
(``row_header``), so that rows of 16, 32, 64 ... floats start on a line when the buffer
does: a row then costs one line, not two.

The package's parts, one concern each (a call's data flow through them is above). Each stage
is a function over frozen records (what it needs and what it gives); what differs between one
rank and several is a strategy object, chosen once per call:

* :mod:`sokpy.exchange.plan.lookup_plan`: :class:`LookupPlan`, which runs the stages top to bottom in
  its forward and backward, and ``COMBINERS``;
* (in the backend layer) :class:`~sokpy.backends.context.StageContext`, what
  every stage is handed of the runtime (the backend, its array module, the communicator),
  built once per call; no other part reads the runtime's process-wide state;
* :mod:`sokpy.exchange.plan.call`: the call's records (``Call``, ``CallShape``: :func:`describe`'s
  sizes and sort bits, ``DeviceBatch``, ``Header``);
* :mod:`sokpy.exchange.plan.call_tables`: ``CallTables``, the call's table descriptor on the host and
  the backend, the one part of a call that changes as it runs (a dynamic table grows, the
  pooling's source is set);
* :mod:`sokpy.exchange.plan.routing`: the verdict on the routed keys (:func:`read_verdict`: a key
  out of range, a fault in ids parsed on the device), read before the header; the routing
  itself (``route_keys``, the owner rule) is the exchange layer's service,
  :mod:`sokpy.exchange.routing`, which the single-table calls outside a lookup use too;
* :mod:`sokpy.exchange.plan.one_rank`: ``OneRank``, the strategy of a call on one rank (no exchange;
  the backward deduplicates, or on a device the forward, so that its verdict brings the count);
* :mod:`sokpy.exchange.plan.several_ranks`: ``SeveralRanks``, the requester's stages on several ranks
  (``group_keys``, ``exchange_keys``, ``exchange_rows``, and the gradient rows sent back);
* :mod:`sokpy.exchange.plan.owner`: the owner's stages (``gather_owned_rows`` in the forward,
  ``owner_chunk`` in the backward);
* :mod:`sokpy.exchange.plan.dedup`: :class:`~sokpy.exchange.plan.dedup.Dedup`, the call's keys grouped by
  (owner, table) and deduplicated;
* :mod:`sokpy.exchange.plan.dynamic_rows`: the keys' stored rows on their owner (``find_rows``) and the
  dynamic tables' growth, eviction step (``max_rows``) and admission (``admit_after``) before
  it;
* :mod:`sokpy.exchange.plan.pooling`: ``pool`` (``combine_forward``), the outputs over one buffer and
  the weights' gradients;
* :mod:`sokpy.exchange.plan.backward`: the backward's shared stages (the outputs' gradients as the
  kernels read them, ``sum_gradient_rows``);
* :mod:`sokpy.exchange.plan.layout`: the buffers of rows between ranks (:func:`row_header`).

The tables' descriptor the stages hand the kernels (``TableSet``) and the owner rule are the
exchange layer's, beside this package: :mod:`sokpy.exchange.table_sets` and
:mod:`sokpy.exchange.routing`.

Example::

    import torch, sokpy
    sokpy.init()
    v = sokpy.Variable(100, 8, name="plan_example")
    out = sokpy.lookup_sparse(v, [[1, 2], [3]], combiners="sum")   # builds and runs a LookupPlan
"""

from .lookup_plan import COMBINERS, LookupPlan

__all__ = ["LookupPlan", "COMBINERS"]
