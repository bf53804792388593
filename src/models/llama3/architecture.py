"""The LLaMA 3 family, as the rest of the code finds it (src/models/registry.py)."""
from src.models.llama3 import checks
from src.models.llama3.hf import HF
from src.models.llama3.model import Llama3
from src.models.protocol import Architecture

ARCHITECTURE = Architecture(model=Llama3, refusal=checks.refusal, hf=HF)
