"""task=kernel_bench: fused Triton kernels against eager, torch.compile and Liger-Kernel.

It declares no figures of its own (src/tracking/figures.py): its rows are op x shape x mode x
provider, in kernel_bench.{csv,md,png}, not one figure per run."""
