"""The LLaMA 3 family: config.py (its model.* settings and config.json's), model.py, rope.py, hf.py
(Hugging Face checkpoints), checks.py, architecture.py."""
