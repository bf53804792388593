"""perflab's submitit launchers for Hydra (see launchers.py)."""
