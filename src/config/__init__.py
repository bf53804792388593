"""The run's config: the schemas (schema.py, tasks.py) registered in Hydra's ConfigStore on import,
composing outside @hydra.main (compose.py), the settings checks (validate.py) and `--help` (help.py).

Every schema name is re-exported, so `from src.config import RunConfig` reads as before the schemas
had a folder; compose, validate and help are imported by their own paths.
"""
from src.config.schema import *  # noqa: F403  (every schema name: callers import them from here)
