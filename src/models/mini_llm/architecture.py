"""docs/SEED.md's MiniLLM, as the rest of the code finds it (src/models/registry.py): no Hugging Face adapter."""
from src.models.mini_llm import checks
from src.models.mini_llm.model import MiniLLM
from src.models.protocol import Architecture

ARCHITECTURE = Architecture(model=MiniLLM, refusal=checks.refusal)
