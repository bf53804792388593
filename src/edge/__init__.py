"""Edge inference (docs/SEED.md section 3): the trained model exported through IREE to Vulkan and Metal,
or run by torch on MPS, CPU and CUDA, timed as prefill + decode with a static KV cache."""
from src.tracking.figures import register_figures

# task=infer's figures, the headline first; its sweeps draw latency.png too
register_figures("infer", ("decode_tokens_per_s", "decode_p50_ms", "ttft_p50_ms", "prefill_tokens_per_s", "rel_err"),
                 extra=("device_name", "ttft_p90_ms", "decode_p90_ms", "compile_s"), sweep_plots=("latency",))
