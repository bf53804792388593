"""task=train and task=profile: the Trainer (trainer.py), the step and the loop (loop.py), their
figures, checkpoints and records. Their figures, the headline first, as sweeps and src.compare show them:"""
from src.tracking.figures import register_figures

_SHOWN = ("tokens_per_s_per_device", "mfu", "peak_mem_gb", "final_loss", "step_time_s")
register_figures("train", _SHOWN, extra=("tokens_per_s", "overhead_frac", "mfu_causal", "joules_per_token", "cost_per_mtok"))
register_figures("profile", _SHOWN, extra=("tokens_per_s",))
