"""Pre-tokenized corpora, nanoGPT's way: token ids in flat binary shards (uint16 where the vocabulary
fits, else uint32), memory-mapped, beside a meta.json and the tokenizer that made them.

    DIR/meta.json          {"vocab_size", "dtype", "shards": [[file, tokens], ...], "max_ids", "eos_id", "tokenizer"}
    DIR/tokens_00000.bin   ...
    DIR/tokenizer.json     the Hugging Face `tokenizers` file that encoded them

`python -m src.data.prepare` writes them; `TokenShards` reads windows of seq_len + 1 tokens from any
position without reading the rest (a window never crosses a shard's end).
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

META = "meta.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenDataError(ValueError):
    """A folder that is not a prepared corpus, or one this run cannot use; the message names the fix."""


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_meta(folder: Path) -> dict:
    path = Path(folder) / META
    if not path.is_file():
        raise TokenDataError(f"data.tokens_path={folder}: no {META} there; make one with `python -m src.data.prepare --out {folder} ...`")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenDataError(f"data.tokens_path={folder}: {META} is cut off or not JSON ({err}); prepare the folder again") from None
    missing = [k for k in ("vocab_size", "dtype", "shards") if k not in (meta if isinstance(meta, dict) else {})]
    if missing:
        raise TokenDataError(f"data.tokens_path={folder}: {META} has no {', '.join(missing)}; prepare the folder with `python -m src.data.prepare`")
    if meta.get("dtype") not in DTYPES:
        raise TokenDataError(f"data.tokens_path={folder}: {META} names dtype {meta.get('dtype')!r}, not uint16 or uint32")
    return meta


def check_shards(folder: Path, meta: dict) -> None:
    """Each shard is the size meta.json says (tokens x the dtype's bytes): a shard written as uint32
    where meta.json says uint16 would read every second token as 0, and train on it."""
    itemsize = np.dtype(DTYPES[meta["dtype"]]).itemsize
    for name, n in meta["shards"]:
        path = Path(folder) / name
        if not path.is_file():
            raise TokenDataError(f"data.tokens_path={folder}: {META} lists {name}, which is not there; prepare the folder again")
        size = path.stat().st_size
        if size != n * itemsize:
            raise TokenDataError(f"data.tokens_path={folder}: {name} holds {size:,} bytes where {META} says {n:,} {meta['dtype']} tokens "
                                 f"({n * itemsize:,} bytes): a shard of another dtype, or cut off; prepare the folder again")


def max_token_id(meta: dict) -> int | None:
    """The largest token id in the shards, from meta.json (prepare records each shard's); None for a
    folder prepared before it did."""
    ids = meta.get("max_ids")
    return max(ids) if ids else None


@dataclass
class TokenShards:
    """The shards of a prepared corpus, memory-mapped; windows addressed by one index over all of them."""

    folder: Path
    window: int
    """tokens a window holds: seq_len + 1 (inputs and the targets one to the right)"""

    def __post_init__(self):
        self.meta = read_meta(self.folder)
        check_shards(self.folder, self.meta)
        dtype = DTYPES[self.meta["dtype"]]
        self.arrays = [np.memmap(Path(self.folder) / name, dtype=dtype, mode="r", shape=(n,)) for name, n in self.meta["shards"]]
        counts = [max(len(a) - self.window + 1, 0) for a in self.arrays]
        self.starts = np.cumsum([0, *counts]).tolist()  # windows before each shard
        if self.starts[-1] == 0:
            raise TokenDataError(f"data.tokens_path={self.folder}: no shard holds {self.window} tokens (data.seq_len + 1); "
                                 "prepare more text or lower data.seq_len")

    @property
    def windows(self) -> int:
        return self.starts[-1]

    def read(self, index: int) -> np.ndarray:
        """Window `index` (0 <= index < windows): `window` consecutive tokens of one shard."""
        shard = bisect.bisect_right(self.starts, index) - 1
        offset = index - self.starts[shard]
        return np.asarray(self.arrays[shard][offset: offset + self.window])


def write_shards(folder: Path, token_lists, vocab_size: int, eos_id: int | None, tokenizer: str, shard_tokens: int = 100_000_000) -> dict:
    """Write the documents' token ids (an iterable of lists), each followed by `eos_id` where given, as
    shards of at most `shard_tokens`; returns meta.json's content."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for(vocab_size)
    shards: list[list] = []
    max_ids: list[int] = []
    buffer: list[int] = []

    def flush() -> None:
        if buffer:
            name = f"tokens_{len(shards):05d}.bin"
            np.asarray(buffer, dtype=DTYPES[dtype]).tofile(folder / name)
            shards.append([name, len(buffer)])
            max_ids.append(max(buffer))  # what a run checks its vocabulary against, without reading the shard
            buffer.clear()

    for ids in token_lists:
        buffer.extend(ids)
        if eos_id is not None:
            buffer.append(eos_id)
        while len(buffer) >= shard_tokens:
            rest = buffer[shard_tokens:]
            del buffer[shard_tokens:]
            flush()
            buffer.extend(rest)
    flush()
    meta = {"vocab_size": vocab_size, "dtype": dtype, "shards": shards, "max_ids": max_ids, "tokens": sum(n for _, n in shards),
            "eos_id": eos_id, "tokenizer": tokenizer}
    (folder / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
