"""Edge inference (SEED.md section 3): the trained model exported through IREE to Vulkan and Metal,
or run by torch on MPS, CPU and CUDA, timed as prefill + decode with a static KV cache."""
