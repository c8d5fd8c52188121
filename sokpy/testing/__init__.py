"""Test doubles of what sokpy's device path runs on, for machines without a GPU.

* :mod:`sokpy.testing.device_double`: an asynchronous double of a GPU and of CuPy's array
  module (work queued per stream, poisoned memory, counted host reads);
* :mod:`sokpy.testing.nccl_double`: NCCL's calls over MPI;
* :mod:`sokpy.testing.emulated`: the backend that runs sokpy's device code path on them
  (``SOKPY_EMULATE_DEVICE=1``).

Importing this package registers the emulated device with the runtime's registry of
backends (``sokpy.backends.registry``, as ``"emulated"``); nothing in sokpy's layers imports
it: when ``SOKPY_EMULATE_DEVICE=1`` asks for the emulated device, the package's finder
(``sokpy/__init__.py``) imports it.

Example::

    import sokpy.testing
    from sokpy.backends import registry
    assert "emulated" in registry.registered()
"""

from ..backends import registry


def _build_emulated(world):
    """The emulated device for ``world``; its module (and the doubles) imported only now."""
    from .emulated import build

    return build(world)


registry.register("emulated", _build_emulated)
