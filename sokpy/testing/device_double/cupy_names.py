"""The names the installed CuPy has, for the device double (:mod:`sokpy.testing.device_double`):
where CuPy is installed (it imports without a GPU), a routine, method or ufunc method CuPy does
not have raises here too. Only CuPy's names are consulted, never its arrays."""

from __future__ import annotations


def installed_cupy():
    """The installed CuPy module (only its names are consulted), or None."""
    global _CUPY
    if _CUPY is False:
        try:
            import cupy  # optional dependency: only its names are consulted
        except Exception:  # not installed, or a build that does not import here
            cupy = None
        _CUPY = cupy
    return _CUPY


_CUPY = False


def require_cupy_name(owner_name: str, owner, name: str) -> None:
    cp = installed_cupy()
    if cp is None:
        return
    target = cp if owner is None else owner(cp)
    if not hasattr(target, name):
        raise AttributeError(f"CuPy {cp.__version__} has no {owner_name}{name} (emulated CuPy, SOKPY_EMULATE_DEVICE)")
