"""The exchange layer: how one call's keys, rows and gradients travel between ranks.

* :mod:`~sokpy.exchange.collective`: the agreement every collective call passes first (one
  header: the same operation, tables and verdict on every rank, or the same error on all);
* :mod:`~sokpy.exchange.plan`: one ``lookup_sparse`` call as named stages (route, dedup, key
  exchange, owner fetch, row exchange, pool, and the backward);
* :mod:`~sokpy.exchange.routing`: the routing service: the owner of every key (``route_keys``,
  which the plan's route stage runs too), a shard's own keys (``rows_of``), and the one
  exchange of rows to their owners (``send_to_owners``) that assign, the checkpoints and the
  optimizers' states use;
* :mod:`~sokpy.exchange.table_sets`: tables as the kernels see them (``TableSet``);
* :mod:`~sokpy.exchange.gradients`: sparse gradients, merged per owner;
* :mod:`~sokpy.exchange.grad_merge`: gradient rows of equal (table, row) summed on the device;
* :mod:`~sokpy.exchange.wire`: the 16-bit formats of rows between ranks.

It uses the tables' storage (``sokpy.storage``) and the backend (``sokpy.backends``), never
the public API above it.
"""
