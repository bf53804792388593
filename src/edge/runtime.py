"""Run compiled edge modules through iree.runtime, and the same model through torch, behind one
interface: prefill(tokens) -> (logits, state), decode(token, pos, state) -> (logits, state).

Reading results back on Vulkan: `DeviceArray.to_host()` imports a host pointer into the driver,
which Vulkan allows only for 4096-byte aligned pointers and sizes (minImportedHostPointerAlignment),
so it fails for ordinary arrays. Results are copied instead into a host-visible staging buffer
allocated by the driver (queue_copy, then map). The KV cache never leaves the device: each call's
cache outputs are the next call's inputs.

Zero-copy (SEED.md section 3): on unified-memory devices the driver can import page-aligned host
memory as a device buffer. `transfer_times` measures both paths for a buffer the size of the KV
cache: a copy into device memory against importing the host pages, and the staging readback.
"""
from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from src.edge.compile import TORCH_DTYPES, Artifacts
from src.edge.model import EdgeLM

PAGE = 4096


class IreeRunner:
    def __init__(self, artifacts: Artifacts, driver: str):
        import iree.runtime as rt

        self.rt = rt
        self.config = rt.Config(driver)
        self.device = self.config.device
        index = rt.ParameterIndex()
        index.load(str(artifacts.irpa))
        instance = self.config.vm_instance
        modules = [
            rt.create_hal_module(instance, self.device),
            rt.create_io_parameters_module(instance, index.create_provider(scope="model")),
            rt.VmModule.mmap(instance, str(artifacts.vmfb)),
        ]
        self.context = rt.VmContext(instance, modules=modules)
        main = modules[-1]
        self._prefill = rt.FunctionInvoker(self.context, self.device, main.lookup_function("prefill"))
        self._decode = rt.FunctionInvoker(self.context, self.device, main.lookup_function("decode"))
        self.driver = driver

    def read(self, array: Any) -> np.ndarray:
        """A device array to numpy through a driver-allocated host-visible staging buffer."""
        rt = self.rt
        buffer = array._buffer_view.get_buffer()
        staging = self.device.allocator.allocate_buffer(
            memory_type=rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
            allowed_usage=rt.BufferUsage.TRANSFER | rt.BufferUsage.MAPPING, allocation_size=buffer.byte_length(),
        )
        done = self.device.create_semaphore(0)
        self.device.queue_copy(buffer, staging, [], [(done, 1)])
        done.wait(1)
        return np.array(staging.map().asarray(array.shape, array.dtype))  # copy out before the staging buffer goes

    def prefill(self, tokens: np.ndarray) -> tuple[np.ndarray, Any]:
        logits, k, v = self._prefill(tokens.astype(np.int32))
        return self.read(logits), (k, v)

    def decode(self, token: np.ndarray, pos: int, state: Any) -> tuple[np.ndarray, Any]:
        logits, k, v = self._decode(token.astype(np.int32), np.array([pos], dtype=np.int32), *state)
        return self.read(logits), (k, v)

    def transfer_times(self, nbytes: int, repeats: int = 5) -> dict[str, float | None]:
        """Median ms to put `nbytes` of host data on the device by copy and by importing page-aligned
        host memory (None where the driver cannot import host pointers), and to read it back."""
        rt = self.rt
        size = -(-nbytes // PAGE) * PAGE
        raw = np.empty(size + PAGE, dtype=np.uint8)
        host = raw[(-raw.ctypes.data) % PAGE:][:size]
        host[:] = 1
        usage = rt.BufferUsage.DEFAULT

        def timed(fn) -> float:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
            return statistics.median(times)

        copy_ms = timed(lambda: self.device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=usage, device=self.device, buffer=host, element_type=rt.HalElementType.UINT_8))
        try:
            import_ms = timed(lambda: self.device.allocator.import_host_allocation(host, rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE, usage))
        except (RuntimeError, ValueError):  # the driver has no VK_EXT_external_memory_host
            import_ms = None
        view = self.device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=usage, device=self.device, buffer=host, element_type=rt.HalElementType.UINT_8)
        device_array = rt.DeviceArray(self.device, view)
        readback_ms = timed(lambda: self.read(device_array))
        return {"transfer_bytes": size, "h2d_copy_ms": copy_ms, "h2d_import_ms": import_ms, "d2h_staging_ms": readback_ms}


class TorchRunner:
    """EdgeLM in torch on cpu, cuda or mps: the baselines, and the MPS backend itself."""

    def __init__(self, lm: EdgeLM, device: str, dtype: str):
        self.device = torch.device(device)
        self.lm = lm.to(device=self.device, dtype=TORCH_DTYPES[dtype]).eval()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    @torch.no_grad()
    def prefill(self, tokens: np.ndarray) -> tuple[np.ndarray, Any]:
        logits, k, v = self.lm.prefill(torch.from_numpy(tokens).to(self.device))
        return logits.float().cpu().numpy(), (k, v)  # .cpu() waits for the device

    @torch.no_grad()
    def decode(self, token: np.ndarray, pos: int, state: Any) -> tuple[np.ndarray, Any]:
        logits, k, v = self.lm.decode(torch.from_numpy(token).to(self.device), torch.tensor([pos], device=self.device), *state)
        return logits.float().cpu().numpy(), (k, v)


def vulkan_devices() -> list[dict[str, Any]]:
    """Vulkan devices IREE sees, with whether each supports VK_KHR_cooperative_matrix (from
    `vulkaninfo`, when installed; None where it is not)."""
    import iree.runtime as rt

    try:
        devices = rt.get_driver("vulkan").query_available_devices()
    except RuntimeError:
        return []
    extensions = _vulkaninfo_extensions()
    out = []
    for i, d in enumerate(devices):
        exts = extensions.get(i)
        out.append({"name": d["name"], "cooperative_matrix": None if exts is None else "VK_KHR_cooperative_matrix" in exts})
    return out


def _vulkaninfo_extensions() -> dict[int, set[str]]:
    exe = shutil.which("vulkaninfo")
    if exe is None:
        return {}
    try:
        text = subprocess.run([exe], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[int, set[str]] = {}
    for match in re.finditer(r"^GPU(\d+):\n(.*?)(?=^GPU\d+:|\Z)", text, flags=re.S | re.M):
        found[int(match.group(1))] = set(re.findall(r"\b(VK_\w+)\s*:", match.group(2)))
    return found
