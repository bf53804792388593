"""Run compiled edge modules through iree.runtime, and the same model through torch, behind one
interface: prefill(tokens) -> (token, logits), decode(token, pos) -> (token, logits), both handles
to device memory, decode_token(token, pos) -> token (the timed loop's step: no logits result);
tokens(handle) reads the greedy tokens (B int32) to the host, logits(handle) the logits (only to
check them against torch).

Decode on a GPU (issue 13): the KV cache is module state (src/edge/model.py), the token chosen on
the device goes straight back in as the next call's input, and the position is a device array made
once per position, so a step moves B int32s to the host and nothing else.

Reading results back on Vulkan: `DeviceArray.to_host()` imports a host pointer into the driver,
which Vulkan allows only for 4096-byte aligned pointers and sizes (minImportedHostPointerAlignment),
so it fails for ordinary arrays. `Readback` keeps one target per size for the whole run: the
output mapped where the driver made it host-visible and mappable, else a page-aligned host array
imported once (VK_EXT_external_memory_host; the copy lands in it, no staging buffer), else one
staging buffer allocated once and mapped once. Each read is then one small DMA and one wait.

Zero-copy (docs/SEED.md section 3): on unified-memory devices the driver can import page-aligned host
memory as a device buffer. `transfer_times` measures both paths for a buffer the size of the KV
cache: a copy into device memory against importing the host pages, and the readback.
"""
from __future__ import annotations

import logging
import re
import shutil
import statistics
import subprocess
import time
from typing import Any

import numpy as np
import torch

from src.dtypes import torch_dtype
from src.edge.compile import Artifacts
from src.edge.model import EdgeLM

PAGE = 4096
log = logging.getLogger("src.edge")


READBACK_MODES = ("mapped", "imported", "staging")


class Readback:
    """Device buffers to numpy through targets made once per byte size (see the module docstring).
    `modes` are the ways it may take, in order of preference; a test names one to run that path
    where the driver would choose another (lavapipe imports, NVIDIA's driver took staging)."""

    def __init__(self, rt: Any, device: Any, modes: tuple[str, ...] = READBACK_MODES, poll: bool = False):
        unknown = set(modes) - set(READBACK_MODES)
        if unknown or not modes:
            raise ValueError(f"readback modes {modes}: use some of {READBACK_MODES}")
        self.rt, self.device, self.modes = rt, device, modes
        self.targets: dict[int, tuple[Any, np.ndarray]] = {}
        self.mode = ""
        self.poll = poll
        """spin on the copy's semaphore instead of a blocking wait (IreeRunner's host_wait)"""
        self._done: Any = None
        self._reads = 0

    def _target(self, nbytes: int) -> tuple[Any, np.ndarray]:
        rt, alloc = self.rt, self.device.allocator
        size = -(-nbytes // PAGE) * PAGE
        if "imported" in self.modes:
            raw = np.empty(size + PAGE, dtype=np.uint8)
            host = raw[(-raw.ctypes.data) % PAGE:][:size]
            try:
                buffer = alloc.import_host_allocation(host, rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
                                                      rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_PERSISTENT)
                self.mode = self.mode or "imported"
                return buffer, host
            except (RuntimeError, ValueError):  # no VK_EXT_external_memory_host
                if "staging" not in self.modes:
                    raise
        staging = alloc.allocate_buffer(memory_type=rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
                                        allowed_usage=rt.BufferUsage.TRANSFER | rt.BufferUsage.MAPPING, allocation_size=size)
        self.mode = self.mode or "staging"
        # a dtype instance, not the scalar type: MappedMemory.asarray(shape, np.uint8) raises
        # `RuntimeError: std::bad_cast` (iree-base-runtime 3.13), what ended every NVIDIA Vulkan job
        return staging, staging.map().asarray((size,), np.dtype(np.uint8))

    def read(self, array: Any) -> np.ndarray:
        rt = self.rt
        buffer = array._buffer_view.get_buffer()
        mappable = buffer.memory_type() & int(rt.MemoryType.HOST_VISIBLE) and buffer.allowed_usage() & int(rt.BufferUsage.MAPPING_SCOPED)
        if mappable and "mapped" in self.modes:
            self.mode = self.mode or "mapped"
            return np.array(array._buffer_view.map().asarray(array.shape, array.dtype))
        nbytes = buffer.byte_length()
        if nbytes not in self.targets:
            self.targets[nbytes] = self._target(nbytes)
        target, host = self.targets[nbytes]
        # one timeline for every read (a semaphore made per read costs a driver call each time)
        if self._done is None:
            self._done, self._reads = self.device.create_semaphore(0), 0
        self._reads += 1
        self.device.queue_copy(buffer, target, [], [(self._done, self._reads)])
        spin_wait(self._done, self._reads) if self.poll else self._done.wait(self._reads)
        return host[:nbytes].view(array.dtype).reshape(array.shape).copy()


def mapped_int32(rt: Any, device: Any, shape: tuple[int, ...]) -> tuple[Any, Any, np.ndarray]:
    """An int32 buffer of `shape` in host-visible, device-visible coherent memory, mapped once:
    (its device array, the mapping, which must be held while the host view lives, the host view)."""
    buffer = device.allocator.allocate_buffer(
        memory_type=int(rt.MemoryType.HOST_LOCAL) | int(rt.MemoryType.HOST_COHERENT) | int(rt.MemoryType.DEVICE_VISIBLE),
        allowed_usage=int(rt.BufferUsage.TRANSFER) | int(rt.BufferUsage.DISPATCH_STORAGE) | int(rt.BufferUsage.MAPPING),
        allocation_size=4 * int(np.prod(shape)))
    mapping = buffer.map()
    return rt.DeviceArray(device, rt.HalBufferView(buffer, shape, rt.HalElementType.SINT_32)), mapping, mapping.asarray(shape, np.dtype(np.int32))


class TokenBuffers:
    """The two [B] int32 buffers decode_token_into writes the next token into: the runner's own, in
    host-visible, device-visible coherent memory, each mapped once for the run. A step then
    allocates no result and its token is read where the device wrote it, after the call's fence:
    no staging copy, no second submission. Two, used in turn, so a call never writes the buffer
    its token input is read from."""

    def __init__(self, rt: Any, device: Any, batch: int):
        # the mappings held: the host arrays are views of them
        self.arrays, self._maps, self.host = (list(t) for t in zip(*(mapped_int32(rt, device, (batch,)) for _ in range(2))))

    def other_than(self, token: Any) -> Any:
        return self.arrays[1] if token is self.arrays[0] else self.arrays[0]

    def read(self, handle: Any) -> np.ndarray | None:
        """The token in `handle` when it is one of these buffers (the call's fence already passed)."""
        for array, host in zip(self.arrays, self.host):
            if handle is array:
                return host.copy()
        return None


class PromptBuffer:
    """The prompt's [B, T] int32 in host-visible, device-visible coherent memory of the runner's own,
    mapped once: a prefill reads the tokens where the host wrote them, with no upload before its
    call (FunctionInvoker turns a numpy prompt into a device buffer: an allocation, a transfer and
    a wait each prefill)."""

    def __init__(self, rt: Any, device: Any, batch: int, prompt_len: int):
        self.array, self._map, self.host = mapped_int32(rt, device, (batch, prompt_len))  # _map held: `host` is a view of it

    def write(self, tokens: np.ndarray) -> Any:
        if tokens.shape != self.host.shape:
            raise ValueError(f"a prompt of shape {tokens.shape}; this module was compiled for {self.host.shape}")
        self.host[...] = tokens
        return self.array


SPIN_LIMIT_S = 30.0


def spin_wait(semaphore: Any, value: int) -> None:
    """Wait for `semaphore` to reach `value` by polling it. A blocking wait on NVIDIA's Vulkan driver
    woke most of a millisecond after the work was done, where polling sees it at once
    (benchmarks/edge_roundtrip.py measures the waits); CUDA's own synchronise spins by default. Past
    SPIN_LIMIT_S the blocking wait takes
    over, so a failed or lost device still raises its error."""
    deadline = time.perf_counter() + SPIN_LIMIT_S
    while semaphore.query() < value:
        if time.perf_counter() > deadline:
            semaphore.wait(value)
            return


class ModuleLoadFailed(RuntimeError):
    """The driver refused the compiled module (pipeline creation) or failed running it."""


# Mesa's CPU Vulkan driver, as IREE names its device
LAVAPIPE = "llvmpipe"
LAVAPIPE_TRIES = 4


def lost_device(text: str) -> bool:
    """Whether an IREE error is a lost device (lavapipe's, IreeRunner below)."""
    return "DATA_LOSS" in text or "DEVICE_LOST" in text


def run_tool(cmd: list[str], lavapipe: bool, timeout: float) -> subprocess.CompletedProcess:
    """Run an IREE tool that makes a context of its own on the Vulkan device (iree-benchmark-module).
    On lavapipe a run that lost the device, or died of a signal, is run again, LAVAPIPE_TRIES in all,
    as IreeRunner makes its context again (the same Mesa fault: a 2-worker test run lost it in
    iree-benchmark-module once where three runs alone did not, and once a prefill profile ended with
    no output at all, stdout's buffer gone with the process); elsewhere, or with any other error,
    the first result stands. Returns the last run's result."""
    for attempt in range(LAVAPIPE_TRIES if lavapipe else 1):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        crashed = proc.returncode < 0
        if proc.returncode == 0 or not (crashed or lost_device(proc.stderr + proc.stdout)) or attempt + 1 == LAVAPIPE_TRIES:
            return proc
        why = f"died of signal {-proc.returncode}" if crashed else "lost the device"
        log.warning("lavapipe: %s %s (try %d of %d); again", cmd[0].rsplit("/", 1)[-1], why, attempt + 1, LAVAPIPE_TRIES)
    return proc


def lavapipe_retry(make_runner: Any, work: Any, lavapipe: bool) -> Any:
    """work(make_runner(fresh_device)) once; on lavapipe, where the device was lost during the work
    (IreeRunner's docstring: the Mesa fault surfaces at any later wait too), again on a runner with
    a new device, LAVAPIPE_TRIES in all, each retry logged. Any other error, or a loss on any other
    driver, is raised at once. Returns work's result; make_runner is called once a try, so it can
    count them, a failed run's included."""
    tries = 1
    while True:
        try:
            return work(make_runner(tries > 1))
        except RuntimeError as err:
            if isinstance(err, ModuleLoadFailed) or not (lavapipe and lost_device(str(err))) or tries == LAVAPIPE_TRIES:
                raise
            log.warning("lavapipe lost the device during the run (try %d of %d: %s); again on a new device", tries, LAVAPIPE_TRIES,
                        one_line(err, 160))
            tries += 1


_KEPT_DEVICES: list[Any] = []


def _new_device(rt: Any, driver: str) -> Any:
    """A device of its own, kept for the life of the process as IREE keeps its shared one: released
    while arrays made on it still live, it segfaults the process when they go (iree-base-runtime 3.13)."""
    _KEPT_DEVICES.append(rt.get_driver(driver).create_default_device())
    return _KEPT_DEVICES[-1]


class IreeRunner:
    """A compiled module on one IREE device.

    Mesa 22.3's lavapipe (Debian 12) with iree-base-runtime 3.13 loses the device now and then while
    a context runs the module's initializer (`DATA_LOSS` / `VK_ERROR_DEVICE_LOST` at
    `hal.fence.await`): measured 1 in 16 first contexts of a fresh process, and 9 to 39 in 40 when
    one process makes context after context on the device; for tiny's fp16 module, 3 in 30 fresh
    processes and 42 in 640 contexts, 0 to 10 in each process's 80 (benchmarks/notes/2026-12-05-edge-quant.md).
    Mesa declares the loss in vkSignalSemaphore, called from a thread of IREE's own while the caller
    waits (4 of 4 losses stopped there under gdb with MESA_VK_ABORT_ON_DEVICE_LOSS=1): lavapipe has
    no timeline semaphores of its own, and Mesa's emulation of them (vk_sync_timeline.c) answers a
    host signal whose value the timeline already reached with "Timeline values must only ever
    strictly increase." The Khronos validation layer flags a host signal above a pending signal
    of the same semaphore (VUID-VkSemaphoreSignalInfo-value-03259) before 6 of 15 losses in 800
    contexts and before 21 of the 785 that finished: a race in IREE's use of the semaphore, which
    the layer catches only at times. No runtime flag changed it (robust buffer access, tracing, the
    compute queue), nor const-eval or hoisting off. The caller sees the loss at its next wait: the
    initializer's fence, or the first upload after the context (`vkWaitSemaphores`; 3 of those 42),
    so the retried block ends with that upload; past it, no loss surfaced in a prefill and 4 decode
    steps of any of the 1383 contexts that got there, each giving the first context's tokens, and
    100 prefill + decode loops give identical tokens. So on lavapipe a lost device is made anew and
    the context tried again (LAVAPIPE_TRIES in all, each retry logged); on any other driver the
    first error ends the run. The campaign runs each module in a process of its own.

    Rarer, a loss past the first upload: one in a CI run of the whole suite (two workers), at a
    token's readback in the third decode step of a generation. `lavapipe_retry` below runs such
    work again on a runner with a device of its own."""

    def __init__(self, artifacts: Artifacts, driver: str, readback: tuple[str, ...] = READBACK_MODES, flags: tuple[str, ...] = (),
                 host_wait: str = "auto", token_out: str = "caller", fresh_device: bool = False):
        import iree.runtime as rt

        self.rt = rt
        if flags:  # runtime flags (`--vulkan_tracing=false`): read when the process's device is made
            rt.flags.parse_flags(*flags)
        # by name only: vulkan_devices() would run `vulkaninfo` again, which the task already ran
        lavapipe = driver == "vulkan" and on_lavapipe()
        for attempt in range(LAVAPIPE_TRIES if lavapipe else 1):
            # the process's shared device first; after a loss (or with fresh_device: the shared one
            # was lost under an earlier runner, and a lost device stays lost), a device of its own
            own = attempt > 0 or fresh_device
            self.config = rt.Config(device=_new_device(rt, driver)) if own else rt.Config(driver)
            self.device = self.config.device
            try:
                modules = self._load(artifacts)
                # the first wait after the initializer's queue work, where 3 of 42 losses surfaced: retried too
                positions = [rt.asdevicearray(self.device, np.array([p], dtype=np.int32)) for p in range(artifacts.manifest["max_seq"])]
                break
            except (RuntimeError, ValueError) as err:
                if not (lavapipe and lost_device(str(err))) or attempt + 1 == LAVAPIPE_TRIES:
                    raise ModuleLoadFailed(one_line(err)) from None
                log.warning("lavapipe lost the device making the context (try %d of %d: %s); again on a new device", attempt + 1, LAVAPIPE_TRIES,
                            one_line(err, 160))
        main = self.module = modules[-1]
        self._prefill, self._decode, self._kv = (rt.FunctionInvoker(self.context, self.device, main.lookup_function(name))
                                                 for name in ("prefill", "decode", "kv_cache"))
        # modules compiled before decode_token travel to the GPU machine on their own: run them
        # through decode, its logits dropped, rather than fail
        self.has_decode_token = main.lookup_function("decode_token") is not None
        if self.has_decode_token:
            self._decode_token = rt.FunctionInvoker(self.context, self.device, main.lookup_function("decode_token"))
        else:
            log.warning("%s has no decode_token (compiled before it): timed steps call decode and drop its logits", artifacts.vmfb)
        # the token into the runner's own mapped buffers where the module has decode_token_into
        # (and `token_out`: "caller" uses it, "result" keeps decode_token's result buffer to compare)
        into = main.lookup_function("decode_token_into") if token_out == "caller" else None
        self.token_buffers = TokenBuffers(rt, self.device, artifacts.manifest["batch"]) if into is not None else None
        if into is not None:
            self._decode_token_into = rt.FunctionInvoker(self.context, self.device, into)
        self.positions = positions
        # the time to first token through prefill_token_into (modules compiled since it): the prompt
        # written into a mapped buffer of the runner's own, the token into one of token_buffers
        prefill_into = main.lookup_function("prefill_token_into") if self.token_buffers is not None else None
        self.prompt = PromptBuffer(rt, self.device, artifacts.manifest["batch"], artifacts.manifest["prompt_len"]) if prefill_into is not None else None
        if prefill_into is not None:
            self._prefill_token_into = rt.FunctionInvoker(self.context, self.device, prefill_into)
        # poll: decode through decode$async, its fence signalled on a semaphore the host spins on
        self.poll = host_wait == "poll" or (host_wait == "auto" and not lavapipe)
        self.readback = Readback(rt, self.device, readback, self.poll)
        self.driver = driver
        if self.poll:
            self._decode_async = main.lookup_function("decode$async")
            self._decode_token_async = main.lookup_function("decode_token$async") if self.has_decode_token else None
            self._decode_token_into_async = main.lookup_function("decode_token_into$async") if into is not None else None
            self._prefill_token_into_async = main.lookup_function("prefill_token_into$async") if self.prompt is not None else None
            self._timeline, self._tick = self.device.create_semaphore(0), 0

    def _load(self, artifacts: Artifacts) -> list[Any]:
        """The module's context on self.device; the driver builds every pipeline here, which is
        where an unsupported dispatch fails, and runs the initializer (parameters in)."""
        rt = self.rt
        index = rt.ParameterIndex()
        index.load(str(artifacts.irpa))
        instance = self.config.vm_instance
        modules = [
            rt.create_hal_module(instance, self.device),
            rt.create_io_parameters_module(instance, index.create_provider(scope="model")),
            rt.VmModule.mmap(instance, str(artifacts.vmfb)),
        ]
        self.context = rt.VmContext(instance, modules=modules)
        return modules

    def prefill(self, tokens: np.ndarray) -> tuple[Any, Any]:
        return self._prefill(tokens.astype(np.int32))

    def prefill_token(self, tokens: np.ndarray) -> Any:
        """prefill's cache writes and next token, no logits result: the time to first token's call.
        Where the module has prefill_token_into, the prompt goes in through the runner's mapped
        buffer (no upload, no wait for one) and the token into one of token_buffers."""
        if self.prompt is None:
            return self.prefill(tokens)[0]
        out = self.token_buffers.arrays[0]
        prompt = self.prompt.write(tokens)
        if self.poll:
            self._invoke_polled_args(self._prefill_token_into_async, (prompt, out), 1)
        else:
            self._prefill_token_into(prompt, out)
        return out

    def decode(self, token: Any, pos: int) -> tuple[Any, Any]:
        if not self.poll:
            return self._decode(token, self.positions[pos])
        return self._invoke_polled(self._decode_async, token, pos, 2)

    def decode_token(self, token: Any, pos: int) -> Any:
        """decode's step and cache update, the next token alone: no logits result is allocated."""
        if self.token_buffers is not None:  # written into the runner's mapped buffer: no result, no copy to read
            out = self.token_buffers.other_than(token)
            if self.poll:
                self._invoke_polled(self._decode_token_into_async, token, pos, 1, out)
            else:
                self._decode_token_into(token, self.positions[pos], out)
            return out
        if not self.has_decode_token:
            return self.decode(token, pos)[0]
        if not self.poll:
            return self._decode_token(token, self.positions[pos])
        return self._invoke_polled(self._decode_token_async, token, pos, 1)[0]

    def _invoke_polled(self, function: Any, token: Any, pos: int, results: int, *more: Any) -> tuple[Any, ...]:
        """`function`$async(token, pos, *more, wait, signal), its signal fence spun on."""
        return self._invoke_polled_args(function, (token, self.positions[pos], *more), results)

    def _invoke_polled_args(self, function: Any, inputs: tuple[Any, ...], results: int) -> tuple[Any, ...]:
        """`function`$async(*inputs, wait, signal), its signal fence spun on."""
        rt = self.rt
        self._tick += 1
        args, rets = rt.VmVariantList(2 + len(inputs)), rt.VmVariantList(results)
        for ref in (*(a._buffer_view for a in inputs), rt.HalFence(0), rt.HalFence.create_at(self._timeline, self._tick)):
            args.push_ref(ref)
        self.context.invoke(function, args, rets)
        spin_wait(self._timeline, self._tick)
        return tuple(rt.DeviceArray(self.device, rets.get_as_object(i, rt.HalBufferView)) for i in range(results))

    def tokens(self, handle: Any) -> np.ndarray:
        mapped = self.token_buffers.read(handle) if self.token_buffers is not None else None
        return mapped if mapped is not None else self.readback.read(handle)

    def logits(self, handle: Any) -> np.ndarray:
        return self.readback.read(handle)

    def host_tokens(self, tokens: np.ndarray) -> Any:
        """(B,) int32 token ids from the host, as decode takes its token (teacher forcing)."""
        return self.rt.asdevicearray(self.device, np.ascontiguousarray(tokens, dtype=np.int32))

    def kv_cache(self) -> tuple[np.ndarray, np.ndarray]:
        k, v = self._kv(np.zeros(1, dtype=np.int32))
        return self.readback.read(k), self.readback.read(v)

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
        readback_ms = timed(lambda: self.readback.read(device_array))
        return {"transfer_bytes": size, "h2d_copy_ms": copy_ms, "h2d_import_ms": import_ms, "d2h_readback_ms": readback_ms}


class TorchRunner:
    """EdgeLM in torch on cpu, cuda or mps: the baselines, and the MPS backend itself. The same
    loop as on IREE: the cache in the module, the greedy token fed back on the device."""

    def __init__(self, lm: EdgeLM, device: str, dtype: str, batch: int, compiled: bool = False):
        self.device = torch.device(device)
        self.lm = lm.to(device=self.device, dtype=torch_dtype(dtype)).resize_cache(batch).eval()
        if compiled:  # torch.compile's baseline: prefill and decode each one graph (pos is a tensor: no recompile per step)
            self.lm.prefill, self.lm.decode = torch.compile(self.lm.prefill), torch.compile(self.lm.decode)
        self.positions = torch.arange(lm.max_seq, dtype=torch.int32, device=self.device).view(-1, 1)

    @torch.no_grad()
    def prefill(self, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lm.prefill(torch.from_numpy(tokens).to(self.device))

    def prefill_token(self, tokens: np.ndarray) -> torch.Tensor:
        return self.prefill(tokens)[0]

    @torch.no_grad()
    def decode(self, token: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lm.decode(token, self.positions[pos])

    @torch.no_grad()
    def decode_token(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        return self.lm.decode_token(token, self.positions[pos])

    def tokens(self, handle: torch.Tensor) -> np.ndarray:
        return handle.cpu().numpy()  # .cpu() waits for the device

    def logits(self, handle: torch.Tensor) -> np.ndarray:
        return handle.float().cpu().numpy()

    def host_tokens(self, tokens: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int32)).to(self.device)

    def kv_cache(self) -> tuple[np.ndarray, np.ndarray]:
        return self.lm.k_cache.float().cpu().numpy(), self.lm.v_cache.float().cpu().numpy()


def one_line(err: BaseException, limit: int = 400) -> str:
    """An IREE error (a status chain over several lines) as one line for the run's last word."""
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def vulkan_device_names() -> list[str]:
    """The Vulkan devices IREE sees, by name (no `vulkaninfo` run)."""
    import iree.runtime as rt

    try:
        return [d["name"] for d in rt.get_driver("vulkan").query_available_devices()]
    except RuntimeError:
        return []


def on_lavapipe() -> bool:
    """Whether IREE's default Vulkan device is Mesa's lavapipe (LAVAPIPE in its name): the device
    `rt.Config("vulkan")` and `create_default_device()` make, the first visible one IREE lists
    (iree_hal_vulkan_driver_create_device_by_id takes index 0 of the list query_available_devices
    gives). A lavapipe installed beside a GPU the runs use does not count: the lost-device retries
    are for lavapipe's fault alone."""
    names = vulkan_device_names()
    return bool(names) and LAVAPIPE in names[0]


def vulkan_devices() -> list[dict[str, Any]]:
    """Vulkan devices IREE sees, with whether each supports VK_KHR_cooperative_matrix (from
    `vulkaninfo`, when installed; None where it is not)."""
    names = vulkan_device_names()
    extensions = _vulkaninfo_extensions() if names else {}
    out = []
    for i, name in enumerate(names):
        exts = extensions.get(i)
        out.append({"name": name, "cooperative_matrix": None if exts is None else "VK_KHR_cooperative_matrix" in exts})
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
