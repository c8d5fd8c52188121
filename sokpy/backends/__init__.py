"""The backend layer: what runs a call's kernels and exchanges, on the host or on a GPU.

* :mod:`~sokpy.backends.runtime`: ``init``, the rank, the backend object in use, entry scopes;
* :mod:`~sokpy.backends.backend`: ``HostBackend`` and ``DeviceBackend`` (array module, memory,
  kernels, stream, hand-off, clock): the one place that knows which backend runs;
* :mod:`~sokpy.backends.communicator`: the interface every communicator implements, and the
  one-process communicator; :mod:`~sokpy.backends.comm`: MPI (the only module that talks to
  it) and its leave notices; :mod:`~sokpy.backends.nccl_comm`: the NCCL communicator;
* :mod:`~sokpy.backends.kernels`: builds and loads ``cuda_src/`` (g++ for the host, NVRTC for a GPU);
* :mod:`~sokpy.backends.handoff`: torch tensors to backend arrays and back;
* :mod:`~sokpy.backends.hostpool`: reused host buffers for a call's arrays;
* :mod:`~sokpy.backends.sorting`: the radix sort of packed sort values;
* :mod:`~sokpy.backends.watchdog`: a failed, stalled or departed rank ends the job;
* :mod:`~sokpy.backends.arrays`: the pointer of any array.

Nothing here imports the layers above it (the storage, the exchange, the public API).
"""
