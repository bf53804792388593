"""`python -m src.export CHECKPOINT [--out model.safetensors]`: a DCP checkpoint (saved by any number
of ranks) to one plain state_dict file for inference, in a single process on the CPU.

The checkpoint's config.yaml gives the model's shape; the file loads into the model (build_model) with
`safetensors.torch.load_file` and `load_state_dict`. With `--hf` (the LLaMA 3 family) the output is a
Hugging Face folder instead, config.json and model.safetensors, that transformers' LlamaForCausalLM
(Qwen2ForCausalLM where q, k and v have biases) loads:

    python -m src.export outputs/.../checkpoints/step_00000100 --hf --out llama-hf

With `--gguf TYPE` (f16, q8_0, q4_0; the same family) the output is one GGUF file for llama.cpp, the
blocks' linear weights in TYPE (src/edge/gguf_file.py):

    python -m src.export outputs/.../checkpoints/step_00000100 --gguf q8_0 --out model-q8_0.gguf
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf


def _check_writable(out: Path, folder: bool) -> None:
    """--out can be written: its folder (made where missing) takes a file. Said before the checkpoint
    is read, not after."""
    import tempfile

    from src.train.checkpoint import CheckpointError

    where = out if folder else out.parent
    if not folder and out.is_dir():
        raise CheckpointError(f"--out {out}: a folder; name the file, e.g. --out {out / 'model.safetensors'}")
    try:
        where.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkstemp(prefix=".perflab_probe_", dir=where)[1]).unlink()
    except OSError as err:
        raise CheckpointError(f"--out {out}: cannot write there ({err.strerror}); give a writable place") from None


def main(argv: list[str] | None = None) -> int:
    from src.edge.gguf_file import TYPES as GGUF_TYPES
    from src.models import architecture, build_model
    from src.train.checkpoint import CheckpointError, export_checkpoint

    ap = argparse.ArgumentParser(prog="python -m src.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a step_NNNNNNNN folder")
    ap.add_argument("--out", type=Path, default=None, help="the file (model.safetensors) or, with --hf, the folder (hf/)")
    ap.add_argument("--hf", action="store_true", help="a Hugging Face folder (config.json, model.safetensors); the LLaMA 3 family only")
    ap.add_argument("--gguf", metavar="TYPE", choices=GGUF_TYPES, default=None,
                    help=f"one GGUF file for llama.cpp, the blocks' linears in TYPE ({', '.join(GGUF_TYPES)}); the LLaMA 3 family only")
    args = ap.parse_args(argv)
    if args.hf and args.gguf:
        ap.error("--hf and --gguf each name the output's format; give one")
    args.out = args.out or Path("hf" if args.hf else f"model-{args.gguf}.gguf" if args.gguf else "model.safetensors")
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
        try:
            model_cfg = OmegaConf.load(config)
        except Exception as err:  # yaml's ParserError, ScannerError, ...: a file cut off or not this project's
            raise CheckpointError(f"{config}: cut off or not YAML ({type(err).__name__}); it tells the model's shape, "
                                  "so the checkpoint cannot be read without it") from None
        adapter = architecture(model_cfg.get("arch", "mini_llm")).hf
        wanted = "--hf writes a Hugging Face folder" if args.hf else "--gguf writes llama.cpp's file from the Hugging Face layout" if args.gguf else None
        if wanted and adapter is None:
            raise CheckpointError(f"{wanted}, and this checkpoint's model is {model_cfg.get('name')} "
                                  f"(arch {model_cfg.get('arch', 'mini_llm')}), which has no Hugging Face adapter; drop {'--hf' if args.hf else '--gguf'} for a plain safetensors file")
        _check_writable(args.out, folder=args.hf)
        model = build_model(model_cfg)
        if args.hf or args.gguf:
            import tempfile

            from safetensors.torch import load_file

            with tempfile.TemporaryDirectory() as tmp:
                export_checkpoint(args.checkpoint, Path(tmp) / "model.safetensors", model)
                folder = args.out if args.hf else Path(tmp) / "hf"
                adapter.save(model, OmegaConf.to_container(model_cfg, resolve=True), load_file(Path(tmp) / "model.safetensors"), folder)
                if args.gguf:
                    from src.edge.gguf_file import GGUFError, write_gguf

                    try:
                        write_gguf(folder, args.out, args.gguf)
                    except GGUFError as err:
                        raise CheckpointError(str(err)) from None
        else:
            export_checkpoint(args.checkpoint, args.out, model)
    except CheckpointError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters from {args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
