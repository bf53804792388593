"""Fused Triton kernels: one file per kernel (the @triton.jit kernel and its launcher, a
torch.autograd.Function with a fused backward, a thin nn.Module), and a registry of op variants
that the `kernels` config group picks from."""
