"""Token batches for training: the seed's random tokens, a byte-level text corpus, or a pre-tokenized
corpus (src/data/tokens.py, made by `python -m src.data.prepare`).

Every step draws one *global* batch of `batch_size * dp_world` sequences from a generator seeded by
(seed, step) and each data-parallel rank takes its own slice. So the data a run sees is fixed by
the seed and the global batch, not by how many ranks share it: a 2-rank FSDP2 run and a 1-rank run
with twice the batch train on the same sequences, which is what the parity tests compare. And a
run resumed from a checkpoint after N steps (the step is saved) draws exactly the batches an
uninterrupted run draws from step N on.
"""
from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch


def stdlib_corpus(megabytes: float) -> bytes:
    """Real text that ships with every Python: the standard library's own .py sources, in a fixed
    order (sorted paths), up to `megabytes`. Code and English docstrings, about 5 bits/byte at start."""
    root = Path(sysconfig.get_paths()["stdlib"])
    budget = int(megabytes * 1e6)
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= budget:
            break
    return b"".join(chunks)[:budget]


class TokenBatches:
    """Iterator of (inputs, targets) int64 tensors of shape (batch_size, seq_len) for one rank."""

    def __init__(
        self,
        source: str,
        vocab_size: int,
        batch_size: int,
        seq_len: int,
        seed: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        device: torch.device | str = "cpu",
        text_path: str | None = None,
        corpus_mb: float = 4.0,
        tokens_path: str | None = None,
    ):
        self.source, self.vocab_size = source, vocab_size
        self.batch_size, self.seq_len = batch_size, seq_len
        self.seed, self.dp_rank, self.dp_world = seed, dp_rank, dp_world
        self.device = torch.device(device)
        self.step = 0
        if source == "text":
            raw = Path(text_path).read_bytes() if text_path else stdlib_corpus(corpus_mb)
            if len(raw) <= seq_len + 1:
                raise ValueError(f"text corpus has {len(raw)} bytes; it needs more than seq_len+1={seq_len + 1}")
            self.corpus = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        elif source == "tokens":
            from src.data.tokens import TokenShards

            self.shards = TokenShards(Path(tokens_path), seq_len + 1)
        elif source != "random":
            raise ValueError(f"data.source={source!r} is not one of: random, text, tokens")

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.dp_rank * self.batch_size, (self.dp_rank + 1) * self.batch_size
        global_batch = self.batch_size * self.dp_world
        gen = self._generator()
        if self.source == "random":
            # Two independent draws, as the seed's torch.randint for tokens and for targets.
            shape = (global_batch, self.seq_len)
            inputs = torch.randint(0, self.vocab_size, shape, generator=gen)[lo:hi]
            targets = torch.randint(0, self.vocab_size, shape, generator=gen)[lo:hi]
        elif self.source == "tokens":
            import numpy as np

            picks = torch.randint(0, self.shards.windows, (global_batch,), generator=gen)[lo:hi]
            window = torch.from_numpy(np.stack([self.shards.read(i) for i in picks.tolist()]).astype(np.int64))
            inputs, targets = window[:, :-1], window[:, 1:]
        else:
            starts = torch.randint(0, len(self.corpus) - self.seq_len - 1, (global_batch,), generator=gen)[lo:hi]
            window = torch.stack([self.corpus[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
            inputs, targets = window[:, :-1], window[:, 1:]
        self.step += 1
        pin = self.device.type == "cuda"
        if pin:
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs.to(self.device, non_blocking=pin), targets.to(self.device, non_blocking=pin)
