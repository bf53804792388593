"""perflab's Optuna sweeper for Hydra (see sweeper.py)."""
