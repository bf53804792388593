"""`python -m src.export CHECKPOINT [--out model.safetensors]`: a DCP checkpoint (saved by any number
of ranks) to one plain state_dict file for inference, in a single process on the CPU.

The checkpoint's config.yaml gives the model's shape; the file loads into `MiniLLM(**config)` with
`safetensors.torch.load_file` and `load_state_dict`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf


def main(argv: list[str] | None = None) -> int:
    from src.models import build_model
    from src.train.checkpoint import CheckpointError, export_checkpoint

    ap = argparse.ArgumentParser(prog="python -m src.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a step_NNNNNNNN folder")
    ap.add_argument("--out", type=Path, default=Path("model.safetensors"))
    args = ap.parse_args(argv)
    config = args.checkpoint / "config.yaml"
    try:
        if not args.checkpoint.is_dir():
            raise CheckpointError(f"{args.checkpoint}: no checkpoint there (no such folder); give a step_NNNNNNNN folder from a run's checkpoints/")
        if not (args.checkpoint / ".metadata").exists():
            inside = sorted(p.name for p in args.checkpoint.glob("step_*") if (p / ".metadata").exists())
            hint = f"; the newest inside is {args.checkpoint / inside[-1]}" if inside else "; give a step_NNNNNNNN folder from a run's checkpoints/"
            raise CheckpointError(f"{args.checkpoint}: no checkpoint there (no DCP .metadata){hint}")
        if not config.exists():
            raise CheckpointError(f"{args.checkpoint}: no config.yaml beside the checkpoint; it tells the model's shape")
        model = build_model(OmegaConf.load(config))
        export_checkpoint(args.checkpoint, args.out, model)
    except CheckpointError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters from {args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
