"""Memory probes for a discrete NVIDIA GPU: CUDA's ``cuMemGetInfo`` or NVML.

:class:`CudaProbe` goes through cuda-python or pycuda (engines/cuda_api.py) and the device's
primary context; :class:`NvmlProbe` needs no context (the nvidia-ml-py package). Both refuse
to run on a Jetson, whose unified memory they misreport (memory/jetson.py). The bindings are
imported only when a probe first reads.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .jetson import is_jetson
from .snapshot import MemorySnapshot


def _import_optional(module: str, probe: str, hint: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"memory probe {probe!r} needs the Python module {module!r} ({hint}): {e}"
        ) from e


def _refuse_on_jetson(probe: str, root: Path) -> None:
    if is_jetson(root):
        raise ConfigError(
            f"memory probe {probe!r} is not supported on Jetson (unified memory: "
            "cudaMemGetInfo/NVML report wrong or no figures there); use 'jetson' or 'auto'"
        )


class CudaProbe:
    """Free/total memory of one CUDA device from ``cuMemGetInfo``, through cuda-python when it is
    installed, else pycuda (edge_batcher/engines/cuda_api.py; `cuda_module` passes a binding in).

    cuMemGetInfo needs a current context. We retain the device's *primary* context (the one
    the CUDA runtime, TensorRT and ONNX Runtime's CUDA EP share) instead of creating our own,
    which would cost a few hundred MB of device memory and would not be the context the
    engines allocate in. It is retained on the first read and released by close().
    """

    name = "cuda"

    def __init__(self, device_index: int = 0, *, root: str | os.PathLike[str] = "/", cuda_module: Any = None):
        if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
            raise ConfigError(f"device_index must be an integer >= 0, got {device_index!r}")
        _refuse_on_jetson(self.name, Path(root))
        self.device_index = device_index
        self._cuda_module = cuda_module
        self._api: Any = None
        self._context: Any = None

    def read(self) -> MemorySnapshot:
        if self._context is None:
            from ..engines.cuda_api import cuda_api_from, load_cuda_api  # noqa: PLC0415 - lazily

            try:
                api = load_cuda_api() if self._cuda_module is None else cuda_api_from(self._cuda_module)
            except ImportError as e:
                raise ConfigError(f"memory probe 'cuda' needs a CUDA Python binding: {e}") from e
            try:
                api.init()
                self._context = api.open_device(self.device_index)
            except Exception as e:  # each binding raises its own error types
                raise ConfigError(
                    f"memory probe 'cuda': cannot open CUDA device {self.device_index} with {api.name}: {e}"
                ) from e
            self._api = api
        self._context.push()
        try:
            free, total = self._api.mem_get_info()
        finally:
            self._context.pop()
        return MemorySnapshot(
            int(total), int(free), f"cuda:{self.device_index}", {"device_index": self.device_index}
        )

    @property
    def binding(self) -> str:
        """The CUDA binding in use ('' before the first read)."""
        return self._api.name if self._api is not None else ""

    def close(self) -> None:
        """Release the primary context reference taken by read()."""
        if self._context is not None:
            self._context.release()
            self._context = None


class NvmlProbe:
    """Free/total memory of one GPU from NVML (the nvidia-ml-py package, module pynvml).

    Unlike CudaProbe it needs no CUDA context, so it costs no device memory. NVML is
    initialised on the first read and shut down by close().
    """

    name = "nvml"

    def __init__(self, device_index: int = 0, *, root: str | os.PathLike[str] = "/"):
        if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
            raise ConfigError(f"device_index must be an integer >= 0, got {device_index!r}")
        _refuse_on_jetson(self.name, Path(root))
        self.device_index = device_index
        self._nvml: Any = None
        self._handle: Any = None

    def read(self) -> MemorySnapshot:
        if self._handle is None:
            nvml = _import_optional("pynvml", self.name, "pip install nvidia-ml-py")
            nvml.nvmlInit()
            self._nvml = nvml
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return MemorySnapshot(
            int(info.total), int(info.free), f"nvml:{self.device_index}",
            {"device_index": self.device_index, "used": int(info.used)},
        )

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
            self._handle = None
