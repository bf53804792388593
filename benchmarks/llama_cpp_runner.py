"""llama.cpp behind the runner interface of src/edge/runtime.py (prefill, decode, their `_token`
forms, tokens, logits, host_tokens), so src/edge/bench.py's timing and src/edge/quality.py's
perplexity run over it unchanged: the same steps, timed and scored the same way as IREE's modules
and torch's.

llama.cpp through llama-cpp-python's bindings (its `Llama` object, every layer offloaded to the GPU
backend it was built with; Vulkan here), fed token ids, never text. One sequence at a time: a batch
of several would be llama.cpp's sequences, which its `Llama` object does not expose, so batch > 1
is refused. A call returns once llama.cpp's logits for it are on the host (llama_get_logits_ith
waits for the device), and the greedy token is the host's argmax of them, as llama.cpp's own greedy
sampler takes it. `timings()` gives llama.cpp's own clock of the same calls (llama_perf_context:
prompt and decode milliseconds), which leaves out the Python around each call.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np


class LlamaCppRunner:
    def __init__(self, gguf: Path, n_ctx: int, gpu_layers: int = -1, batch: int = 1):
        if batch != 1:
            raise ValueError(f"batch {batch}: llama.cpp runs here one sequence at a time; use batch 1")
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_gpu_layers=gpu_layers, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                   logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        pointer = self.llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)  # waits for the device's work
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)).copy()[None]

    def prefill(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if tokens.shape[0] != 1:
            raise ValueError(f"batch {tokens.shape[0]}: llama.cpp runs here one sequence at a time")
        self.llm.reset()  # the cache from position 0 on is dropped by the next eval
        self.llm.eval([int(t) for t in tokens[0]])
        logits = self._last_logits()
        return logits.argmax(-1).astype(np.int32), logits

    def prefill_token(self, tokens: np.ndarray) -> np.ndarray:
        return self.prefill(tokens)[0]

    def decode(self, token: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        self.llm.n_tokens = pos  # what came after pos (a previous generation) is dropped by eval
        self.llm.eval([int(token[0])])
        logits = self._last_logits()
        return logits.argmax(-1).astype(np.int32), logits

    def decode_token(self, token: np.ndarray, pos: int) -> np.ndarray:
        return self.decode(token, pos)[0]

    def tokens(self, handle: np.ndarray) -> np.ndarray:
        return handle

    def logits(self, handle: np.ndarray) -> np.ndarray:
        return handle

    def host_tokens(self, tokens: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(tokens, dtype=np.int32)

    def reset_timings(self) -> None:
        self.llama_cpp.llama_perf_context_reset(self.llm._ctx.ctx)

    def timings(self) -> dict[str, Any]:
        """llama.cpp's own clock since reset_timings: prompt calls (more than one token) and decode calls."""
        data = self.llama_cpp.llama_perf_context(self.llm._ctx.ctx)
        return {"prompt_ms": data.t_p_eval_ms, "prompt_tokens": data.n_p_eval, "decode_ms": data.t_eval_ms, "decode_calls": data.n_eval}

    def device(self) -> str:
        """The Vulkan device llama.cpp offloads to, by ggml-vulkan's description ("" where the build has no Vulkan)."""
        lib = next(iter(sorted(Path(self.llama_cpp.__file__).parent.glob("lib/libggml-vulkan.so*"))), None)
        if lib is None or not self.llama_cpp.llama_supports_gpu_offload():
            return ""
        vk = ctypes.CDLL(str(lib))
        if vk.ggml_backend_vk_get_device_count() < 1:
            return ""
        text = ctypes.create_string_buffer(256)
        vk.ggml_backend_vk_get_device_description(0, text, ctypes.c_size_t(len(text)))
        return text.value.decode()
