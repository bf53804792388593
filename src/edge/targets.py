"""Where an edge module can run: IREE's Vulkan targets, Metal, and the dtypes each can compute in.

`edge.target` is what `--iree-vulkan-target` takes (IREE 3.13): an architecture code name, or an
LLVM-style name (sm_80, gfx1100). The names below are the ones IREE documents; others in those
two LLVM styles pass through. Cooperative-matrix capable targets (VK_KHR_cooperative_matrix:
the GPU's matrix units from portable SPIR-V) are marked, for the comparison docs/SEED.md makes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class VulkanTarget:
    vendor: str
    cooperative_matrix: bool
    dtypes: tuple[str, ...] = ("fp32", "fp16")
    storage8: bool = True
    """8-bit storage buffers (IREE's `storage = ...|b8`): what int8 and int4 weights (edge.quant) are
    read from. IREE 3.13's adreno target has b64|b32|b16 only, and a module with int8 weights fails to
    compile for it (`functions in 'spirv.module' can only contain spirv.* ops`); llvmpipe, valhall,
    rdna2 and ampere compile it."""


VULKAN_TARGETS: dict[str, VulkanTarget] = {
    # Mesa's CPU driver (lavapipe): correctness on machines without a GPU; no bf16 arithmetic
    "llvmpipe": VulkanTarget("mesa", False),
    "turing": VulkanTarget("nvidia", True),
    "ampere": VulkanTarget("nvidia", True),
    "ada": VulkanTarget("nvidia", True),
    "rdna1": VulkanTarget("amd", False),
    "rdna2": VulkanTarget("amd", False),
    "rdna3": VulkanTarget("amd", True),
    "rdna4": VulkanTarget("amd", True),
    "valhall": VulkanTarget("arm", False),
    "valhall4": VulkanTarget("arm", False),
    "adreno": VulkanTarget("qualcomm", False, storage8=False),
}
_LLVM_STYLE = re.compile(r"^(sm_\d{2,3}a?|gfx\d{3,4}[a-z]?)$")

METAL_PLATFORMS = ("macos", "ios", "ios-simulator")
# what torch computes in on each backend that runs the model directly
BACKEND_DTYPES = {"cpu": ("fp32", "fp16", "bf16"), "cuda": ("fp32", "fp16", "bf16"), "mps": ("fp32", "fp16", "bf16")}


def vulkan_target(name: str) -> VulkanTarget | None:
    """The target, or None if IREE would not know it."""
    if name in VULKAN_TARGETS:
        return VULKAN_TARGETS[name]
    if _LLVM_STYLE.match(name):
        nvidia = name.startswith("sm_")
        coop = int(re.sub(r"\D", "", name)[:2]) >= 75 if nvidia else name >= "gfx11"
        return VulkanTarget("nvidia" if nvidia else "amd", coop)
    return None


def known_targets() -> str:
    return ", ".join(VULKAN_TARGETS) + ", or sm_XX / gfxNNNN"


# Words in a Vulkan device name (VkPhysicalDeviceProperties::deviceName) that say who made it
_VENDOR_WORDS = {
    "mesa": ("llvmpipe",),
    "nvidia": ("nvidia", "geforce", "quadro", "tesla", "rtx"),
    "amd": ("amd", "radeon"),
    "arm": ("mali",),
    "qualcomm": ("adreno",),
}
# What to compile with instead, by the vendor of the device found
_TARGET_FOR = {"mesa": "llvmpipe", "nvidia": "ampere (or pascal: no cooperative matrices)", "amd": "rdna3", "arm": "valhall", "qualcomm": "adreno"}


def target_mismatch(target: str, device_name: str) -> str | None:
    """Why a module compiled for `target` must not run on the Vulkan device `device_name`, or None.

    SPIR-V from IREE is tuned to its target and only as portable as the driver's checks. The case
    in issue 13: `edge.target=adreno` on lavapipe loads and runs, and its logits are off by a
    relative 1.09 (2.0 for model=tiny at dim 64 now; rdna2 on lavapipe 1.05; llvmpipe 5e-7). The
    adreno target promises 64-lane subgroups (`subgroup_size_choices = [64]`, rdna2 [32, 64]) and
    its reductions (RMSNorm, softmax, the argmax) are laid out for them; lavapipe runs 8-lane
    subgroups (`vulkaninfo`: subgroupSize = 8; its own target says [8]) and never refuses the
    pipeline, so each reduction sums a part of its row. Nothing fails, the numbers are wrong:
    refuse before running. NVIDIA targets (subgroup 32) match NVIDIA's driver (32)."""
    spec = vulkan_target(target)
    name = device_name.lower()
    found = next((vendor for vendor, words in _VENDOR_WORDS.items() if any(w in name for w in words)), None)
    if spec is None or found is None or found == spec.vendor:
        return None
    return (f"edge.target={target} artifacts are for {spec.vendor} GPUs and this Vulkan device is {device_name}: the "
            f"module would run with wrong results (issue 13: adreno on lavapipe, relative error 1.09); "
            f"compile with edge.target={_TARGET_FOR[found]}")
