"""task=kernel_bench: fused Triton kernels against eager, torch.compile and Liger-Kernel."""
