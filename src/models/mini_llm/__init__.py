"""docs/SEED.md's MiniLLM: config.py, model.py, checks.py, architecture.py."""
