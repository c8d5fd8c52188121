"""The node's environment as the check needs to know it, one JSON line on stdout: Python,
torch and its CUDA, the GPUs torch sees (name, compute capability, memory), CuPy, the CUDA
runtime and driver, NVRTC, NCCL, mpi4py and whether it finds an MPI library, g++ (the host
backend's compiler, which builds the reference), compute-sanitizer, FBGEMM, and git and
mpirun on the PATH. Exits 0 whatever it finds: the check decides what it needs."""

import json
import platform
import shutil
import subprocess
import sys


def first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


info: dict = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch

    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if info["cuda_available"]:
        info["gpus"] = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["gpu_memory_gb"] = round(props.total_memory / 1e9, 1)
        info["multiprocessors"] = props.multi_processor_count
except Exception as e:  # noqa: BLE001 - recorded, the check decides
    info["torch_error"] = first_line(e)
try:
    import cupy

    info["cupy"] = cupy.__version__
    info["nvrtc"] = list(cupy.cuda.nvrtc.getVersion())
    info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    info["driver"] = cupy.cuda.runtime.driverGetVersion()
    info["cupy_gpus"] = cupy.cuda.runtime.getDeviceCount()
except Exception as e:  # noqa: BLE001
    info.setdefault("cupy_error", first_line(e))
try:
    from cupy.cuda import nccl

    info["nccl"] = nccl.get_version()
except Exception as e:  # noqa: BLE001
    info["nccl_error"] = first_line(e)
try:
    import mpi4py

    info["mpi4py"] = mpi4py.__version__
    from mpi4py import MPI

    info["mpi_library"] = MPI.Get_library_version().splitlines()[0]
except Exception as e:  # noqa: BLE001 - the node's mpi4py finds no MPI library
    info["mpi_library"] = f"none ({first_line(e)})"
try:
    import fbgemm_gpu

    info["fbgemm_gpu"] = getattr(fbgemm_gpu, "__version__", "?")
except Exception as e:  # noqa: BLE001
    info["fbgemm_gpu"] = f"none ({first_line(e)})"
gxx = shutil.which("g++")
info["g++"] = subprocess.run([gxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0] if gxx else None
for tool in ("compute-sanitizer", "nvcc", "nvidia-smi", "git", "mpirun"):
    info[tool] = shutil.which(tool)
print(json.dumps(info))
