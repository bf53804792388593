"""The Qwen3 family on the LLaMA 3 code: q and k each RMS-normed per head before the rotation
(config.py, model.py, hf.py, architecture.py)."""
