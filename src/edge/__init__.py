"""Edge inference (docs/SEED.md section 3): the trained model exported through IREE to Vulkan and Metal,
or run by torch on MPS, CPU and CUDA, timed as prefill + decode with a static KV cache."""
from src.tracking.figures import is_number, register_figures


def below_quality(row: dict) -> str | None:
    """Why an edge run may not be a sweep's best: its perplexity on held-out text rose over fp32's by
    more than the run's edge.quality_tolerance (src/edge/quality.py)."""
    rise, bound = row.get("perplexity_increase"), row.get("quality_tolerance")
    if is_number(rise) and is_number(bound) and rise > bound:
        return f"perplexity {rise:+.1%} over fp32, past edge.quality_tolerance={bound:g}"
    return None


# task=infer's figures, the headline first; its sweeps draw latency.png too. A quantization sweep
# (edge.quant=none,int8,int4) is read on the perplexity's rise over fp32 (a run past
# edge.quality_tolerance is not ranked: below_quality), the greedy tokens' agreement and the
# archive's and module's bytes beside speed and error, so those are columns of the MLflow view too
register_figures("infer", ("decode_tokens_per_s", "decode_p50_ms", "ttft_p50_ms", "prefill_tokens_per_s", "rel_err", "perplexity_increase",
                           "token_agreement", "params_bytes", "module_bytes"),
                 extra=("device_name", "ttft_p90_ms", "decode_p90_ms", "compile_s", "perplexity", "perplexity_fp32"), sweep_plots=("latency",),
                 excluded=below_quality)
