"""Every kernel of cuda_src/ built by NVRTC for one architecture, the device backend's way
(``sokpy.backends.kernels``: its options, its cache), and with ``--load`` loaded on the GPU
and every kernel looked up, as the device backend does on first use. One JSON line on
stdout: per source file, its kernels, seconds, and whether the CUBIN was built now or found
in the kernel cache.

    python launch/gpu_check/nvrtc_build.py --arch sm_90 [--load]
"""

import argparse
import json
import time

from sokpy.backends import kernels

p = argparse.ArgumentParser()
p.add_argument("--arch", required=True, help="a real architecture, e.g. sm_90")
p.add_argument("--load", action="store_true", help="also load every kernel on the GPU")
args = p.parse_args()
loader = kernels.DeviceKernels(args.arch) if args.load else None
out: dict = {"arch": args.arch, "options": list(kernels.DEVICE_OPTIONS), "loaded": args.load, "files": {}}
for cu in kernels.kernel_sources():
    wall, t0 = time.time(), time.perf_counter()
    path = kernels.device_binary(cu, args.arch)
    built = path.stat().st_mtime >= wall - 1
    names = list(kernels.signatures(cu.read_text()))
    if loader is not None:  # the device backend's loader, one file at a time (timed apart)
        loaded = loader._load(cu)
        assert sorted(loaded) == sorted(names), f"{cu.name}: loaded {sorted(loaded)}, expected {sorted(names)}"
    seconds = round(time.perf_counter() - t0, 2)
    out["files"][cu.name] = dict(
        kernels=len(names), seconds=seconds, cubin=path.name, built=built, bytes=path.stat().st_size
    )
print(json.dumps(out))
