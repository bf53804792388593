"""Qwen3, as the rest of the code finds it (src/models/registry.py)."""
from src.models.llama3 import checks
from src.models.protocol import Architecture
from src.models.qwen3.hf import HF
from src.models.qwen3.model import Qwen3

ARCHITECTURE = Architecture(model=Qwen3, refusal=checks.refusal, hf=HF)
