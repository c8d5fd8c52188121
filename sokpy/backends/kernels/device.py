"""The device build: every ``cuda_src/*.cu`` file compiled with NVRTC (through
``cupy.cuda.nvrtc``, no GPU needed) with :data:`DEVICE_OPTIONS` for the GPU's own
architecture into a CUBIN, cached by a key over the source, its headers, the options, the
architecture and NVRTC's version (:mod:`sokpy.backends.kernels.cache`), and loaded with
``cupy.RawModule`` (:class:`DeviceKernels`). CuPy is imported only on this path."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...timing import timed
from .cache import cached_build, check_private
from .sources import KernelError, KernelSet, Param, check_array, read_headers, signatures

__all__ = ["DEVICE_OPTIONS", "DeviceKernels", "nvrtc_compile", "device_binary", "nvrtc_version"]

# NVRTC options of every device build, the device's side of the host build's IEEE arithmetic:
# --fmad=false: NVRTC fuses a*b+c into one rounding by default, the host build does not
# (-ffp-contract=off, host.py's _HOST_FLAGS); -ftz=false: float32 subnormals are kept, not
# flushed to zero (the NVRTC default, spelt out: CuPy's own RawModule(code=...) adds
# -ftz=true); -prec-div and -prec-sqrt: division and square root correctly rounded, as on the CPU.
DEVICE_OPTIONS = ("-std=c++17", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")


class _DeviceKernel:
    def __init__(self, name: str, fn, params: list[Param]):
        self.name, self.params, self._fn = name, params, fn

    def __call__(self, grid, block, args):
        if len(args) != len(self.params):
            raise KernelError(f"sokpy kernel {self.name}: expected {len(self.params)} arguments, got {len(args)}")
        conv = []
        for p, x in zip(self.params, args):
            if p.pointer:
                conv.append(np.uint64(0) if x is None else np.uint64(check_array(self.name, p, x)))
            else:
                conv.append(p.dtype.type(x))
        if min(grid) <= 0:
            return
        with timed("kernels"):
            self._fn(tuple(grid), tuple(block), tuple(conv))  # on CuPy's current stream


def _nvrtc():
    import cupy  # optional dependency, imported only on the device path

    return cupy.cuda.nvrtc


def nvrtc_version() -> tuple[int, int]:
    """The version of the NVRTC library CuPy loads."""
    return tuple(_nvrtc().getVersion())


def nvrtc_compile(cu: Path, arch: str, binary: bool = False) -> bytes:
    """Compiles one kernel source with NVRTC for ``arch`` with :data:`DEVICE_OPTIONS` and
    returns the PTX (``arch`` a virtual architecture such as ``"compute_90"``) or, with
    ``binary``, the CUBIN (``arch`` a real one such as ``"sm_90"``). Needs no GPU: it goes
    through ``cupy.cuda.nvrtc`` directly. Raises KernelError with the NVRTC log when the
    compilation fails."""
    nvrtc = _nvrtc()
    headers = read_headers(cu.parent)
    prog = nvrtc.createProgram(
        cu.read_text(), cu.name, [h.encode() for h in headers.values()], [n.encode() for n in headers]
    )
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *DEVICE_OPTIONS])
        except nvrtc.NVRTCError as e:
            raise KernelError(f"sokpy: NVRTC failed on {cu.name} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        return nvrtc.getCUBIN(prog) if binary else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def device_binary(cu: Path, arch: str) -> Path:
    """The CUBIN of ``cu`` for ``arch`` (e.g. ``"sm_90"``) in the kernel cache, compiled on
    first use. The key covers the source and its headers, :data:`DEVICE_OPTIONS`, the
    architecture and NVRTC's version, so an edit of any header or an upgrade rebuilds."""

    def build(tmp: Path, out: Path) -> None:
        out.write_bytes(nvrtc_compile(cu, arch, binary=True))

    key = [cu.read_text(), *read_headers(cu.parent).values(), " ".join(DEVICE_OPTIONS), arch, nvrtc_version()]
    return cached_build(f"{cu.stem}-{arch}.cubin", key, build)


class DeviceKernels(KernelSet):
    """Every kernel of ``cuda_src/`` built by NVRTC for the current GPU (``arch``, e.g.
    ``"sm_90"``) and loaded with ``cupy.RawModule``, on first use."""

    def __init__(self, arch: str):
        self.arch = arch

    def _load(self, cu: Path) -> dict:
        import cupy  # optional dependency, imported only on the device path

        path = device_binary(cu, self.arch)
        check_private(path, "kernel binary")  # loading a binary runs its code
        mod = cupy.RawModule(path=str(path))
        return {n: _DeviceKernel(n, mod.get_function(n), ps) for n, ps in signatures(cu.read_text()).items()}
