"""Sharded embedding tables: static (:class:`Variable`) and dynamic (:class:`DynamicVariable`).

A :class:`Variable` is a static table of ``rows`` x ``dim`` float32 (or 16-bit values,
``dtype``): ``target_gpu=-1`` puts key k on rank ``k % W`` at local row ``k // W``;
``target_gpu=r`` puts the whole table on rank r.
A :class:`DynamicVariable` has no fixed key range: every int64 is a valid key, a row is
created the first time its key is looked up (or assigned), and its shard is a hash table
that grows by itself; ``target_gpu=-1`` puts key k on rank ``mix64(k) % W`` (splitmix64's
finalizer), so patterned ids do not pile onto one rank.

Creating a table is a collective call: every rank creates the same tables in the same order,
and the n-th table gets the same identity on every rank. Names are unique in a job (an
automatic one, ``table<N>``, when none is given). A row's initial values are a pure function
of (seed, table name, key, column): the same at every world size, different in every table.

The package's parts, one concern each:

* :mod:`sokpy.tables.table`: :class:`~sokpy.tables.table.Table`, what both kinds share
  (creation as a collective call, identity, unique names, initial-value seed, storage,
  gradients), and :func:`~sokpy.tables.table.live_table_names`;
* :mod:`sokpy.tables.static`: :class:`~sokpy.tables.static.Variable`, a static table;
* :mod:`sokpy.tables.dynamic`: :class:`~sokpy.tables.dynamic.DynamicVariable`, a dynamic
  table (capacity, eviction, admission), and its
  :class:`~sokpy.tables.dynamic.TableStatistics`;
* :mod:`sokpy.tables.access`: a table's rows by key: :func:`~sokpy.tables.access.export`
  (this rank's rows) and :func:`~sokpy.tables.access.assign` (collective).

The public names are ``sokpy.Variable``, ``sokpy.DynamicVariable``, ``sokpy.TableStatistics``,
``sokpy.export`` and ``sokpy.assign``.

Example (any number of ranks)::

    import sokpy
    sokpy.init()
    v = sokpy.Variable(1000, 16, initializer=sokpy.initializers.normal(0, 0.01), name="user")
    d = sokpy.DynamicVariable(16, name="query")      # keys: any int64
    keys, values = sokpy.export(v)                   # this rank's rows
    sokpy.assign(v, keys, values * 2)                # collective
"""
