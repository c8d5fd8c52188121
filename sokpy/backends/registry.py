"""The backends the runtime can build beside its own (the host and the device): a name, and a
function that builds the backend and its communicator for a world.

A package beside the layers registers its backends when it is imported (:func:`register`):
``sokpy.testing`` registers the emulated device (``"emulated"``, which ``SOKPY_EMULATE_DEVICE=1``
asks for). The runtime asks for a backend by name (:func:`build`) and never imports the
package that provides it: for a name nobody has registered yet, the finders that the package
above every layer added (:func:`add_finder`) are asked to import its provider first.

Example::

    import numpy as np
    from sokpy.backends import registry
    from sokpy.backends.communicator import SoloComm

    registry.register("registry_example", lambda world: ("a backend", SoloComm(np)))
    backend, comm = registry.build("registry_example", None)
    assert backend == "a backend" and comm.size == 1
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["register", "add_finder", "build", "registered"]

# The backend object and its communicator, for the job's MpiComm or TorchComm (None: a world
# of one process).
Factory = Callable[[Any], tuple[Any, Any]]

_factories: dict[str, Factory] = {}
_finders: list[Callable[[str], None]] = []


def register(name: str, factory: Factory) -> None:
    """Makes ``factory(world)`` the builder of the backend called ``name`` (a second
    registration of a name replaces the first)."""
    _factories[name] = factory


def add_finder(finder: Callable[[str], None]) -> None:
    """``finder(name)`` is called for a backend nobody has registered yet; it imports the
    package that registers it, if it knows one."""
    if finder not in _finders:
        _finders.append(finder)


def registered() -> list[str]:
    """The names of the backends registered so far."""
    return sorted(_factories)


def build(name: str, world: Any) -> tuple[Any, Any]:
    """``(backend, communicator)`` of the backend called ``name`` for ``world``; raises
    LookupError naming the registered backends when neither a registration nor a finder
    provides it."""
    if name not in _factories:
        for finder in _finders:
            finder(name)
    factory = _factories.get(name)
    if factory is None:
        raise LookupError(f"no backend called {name!r} is registered (registered: {registered() or 'none'})")
    return factory(world)
