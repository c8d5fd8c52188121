"""Test doubles of what sokpy's device path runs on, for machines without a GPU.

* :mod:`sokpy.testing.device_double`: an asynchronous double of a GPU and of CuPy's array
  module (work queued per stream, poisoned memory, counted host reads);
* :mod:`sokpy.testing.nccl_double`: NCCL's calls over MPI;
* :mod:`sokpy.testing.emulated`: the backend that runs sokpy's device code path on them
  (``SOKPY_EMULATE_DEVICE=1``).

Nothing in sokpy imports this package unless asked to.
"""
