"""Fused Triton kernels: one file per kernel (the @triton.jit kernel and its launcher, a
torch.autograd.Function with a fused backward, a thin nn.Module). Imports torch and triton only:
which module of a model each one replaces is src/fusion/ops.py's business.

Imported as `perflab_kernels.triton` (pyproject.toml maps the folder kernels/ to that name): a
top-level `kernels` would shadow Hugging Face's `kernels` package, which transformers imports."""
