"""Which fused variant replaces which module of the model, and kernels=auto's choice: the one part
that knows both the model (src/models/) and the kernel library (kernels/, which knows no model).

ops.py: the op table, one row per kernel, that the others read; registry.py: the swap; choice.py: kernels=auto from a diagnosis;
measure.py: its timing of eager, torch.compile and the fused kernel; compiled.py: single ops under
torch.compile (kernels.compiled); cases.py and timing.py: each op's variants, inputs and bytes, and
their median time, which task=kernel_bench times side by side too."""
