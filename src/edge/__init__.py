"""Edge inference (docs/SEED.md section 3): the trained model exported through IREE to Vulkan and Metal,
or run by torch on MPS, CPU and CUDA, timed as prefill + decode with a static KV cache."""
from src.tracking.figures import register_figures

# task=infer's figures, the headline first; its sweeps draw latency.png too. A quantization sweep
# (edge.quant=none,int8,int4) is read on the greedy tokens' agreement with torch fp32 and the
# archive's and module's bytes beside speed and error, so those are columns of the MLflow view too
register_figures("infer", ("decode_tokens_per_s", "decode_p50_ms", "ttft_p50_ms", "prefill_tokens_per_s", "rel_err", "token_agreement",
                           "params_bytes", "module_bytes"),
                 extra=("device_name", "ttft_p90_ms", "decode_p90_ms", "compile_s"), sweep_plots=("latency",))
