"""Where an edge module can run: IREE's Vulkan targets, Metal, and the dtypes each can compute in.

`edge.target` is what `--iree-vulkan-target` takes (IREE 3.13): an architecture code name, or an
LLVM-style name (sm_80, gfx1100). The names below are the ones IREE documents; others in those
two LLVM styles pass through. Cooperative-matrix capable targets (VK_KHR_cooperative_matrix:
the GPU's matrix units from portable SPIR-V) are marked, for the comparison SEED.md makes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class VulkanTarget:
    vendor: str
    cooperative_matrix: bool
    dtypes: tuple[str, ...] = ("fp32", "fp16")


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
    "adreno": VulkanTarget("qualcomm", False),
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
