"""`python -m src.data.prepare`: text files to a pre-tokenized corpus for `data=tokens`.

    python -m src.data.prepare --tokenizer CHECKPOINT/tokenizer.json --text a.txt b.txt --out data/mine
    python -m src.data.prepare --train-bpe 8192 --text corpus.txt --out data/bpe8k       # a BPE of its own
    python -m src.data.prepare --train-bpe 4096 --out data/stdlib                         # on the standard library's sources

The tokenizer is a Hugging Face `tokenizers` file: the one beside a checkpoint (LLaMA 3's, for
model.hf_path runs), or one trained here by `tokenizers`' byte-level BPE trainer. Each file is one
document, encoded whole and followed by the end-of-text token where the tokenizer has one. The
folder gets meta.json, the shards and tokenizer.json (src/data/tokens.py); train with
`data=tokens data.tokens_path=DIR model.vocab_size=V` (V: meta.json's vocab_size or more).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from src.data.tokens import write_shards

EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|eot_id|>")


def train_bpe(vocab_size: int, texts: list[str]):
    """A byte-level BPE of `vocab_size` tokens trained on `texts`, with an end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def read_text(path: Path) -> str:
    """A text file as one document; ValueError, naming it, for one that is not UTF-8 text (a binary
    would train the tokenizer and the model on its bytes without a word)."""
    data = path.read_bytes()
    if b"\0" in data[:65536]:
        raise ValueError(f"--text {path}: a binary file (it holds NUL bytes), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--text {path}: not UTF-8 (byte {err.start}: {data[err.start:err.start + 1]!r}); convert it, "
                         f"e.g. iconv -f latin1 -t utf-8 {path}") from None


def eos_id(tokenizer) -> int | None:
    return next((i for name in EOS_NAMES if (i := tokenizer.token_to_id(name)) is not None), None)


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    from src.data.batches import stdlib_corpus

    ap = argparse.ArgumentParser(prog="python -m src.data.prepare", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", type=Path, help="a tokenizers file (tokenizer.json)")
    which.add_argument("--train-bpe", type=int, metavar="VOCAB", help="train a byte-level BPE of this many tokens on the text")
    ap.add_argument("--text", type=Path, nargs="*", default=[], help="UTF-8 files, one document each; none: the standard library's sources")
    ap.add_argument("--corpus-mb", type=float, default=4.0, help="without --text: megabytes of the standard library's sources")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens a shard holds at most")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    missing = [p for p in args.text if not p.is_file()]
    if missing:
        sys.stderr.write(f"error: --text {missing[0]}: no such file\n")
        return 2
    if args.train_bpe is not None and args.train_bpe < 257:
        sys.stderr.write(f"error: --train-bpe {args.train_bpe}: a byte-level BPE needs more than its 256 byte tokens and end-of-text\n")
        return 2
    if args.shard_tokens < 1:
        sys.stderr.write(f"error: --shard-tokens {args.shard_tokens}: a shard holds at least 1 token\n")
        return 2
    try:
        texts = [read_text(p) for p in args.text] or [stdlib_corpus(args.corpus_mb).decode("utf-8", "replace")]
    except ValueError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    if not any(texts):
        sys.stderr.write(f"error: --text {' '.join(map(str, args.text))}: no text in it; give a file with text\n")
        return 2
    if args.tokenizer is not None:
        if not args.tokenizer.is_file():
            sys.stderr.write(f"error: --tokenizer {args.tokenizer}: no such file (a tokenizer.json)\n")
            return 2
        try:
            tokenizer, source = Tokenizer.from_file(str(args.tokenizer)), str(args.tokenizer)
        except Exception as err:  # tokenizers raises a bare Exception on a file it cannot parse
            sys.stderr.write(f"error: --tokenizer {args.tokenizer}: not a tokenizers file ({err}); give a checkpoint's tokenizer.json\n")
            return 2
    # the folder before the work: a long encode must not end on a folder it cannot write
    existed = args.out.exists()
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".perflab_probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        sys.stderr.write(f"error: --out {args.out}: cannot write there ({err.strerror}); give a writable folder\n")
        return 2
    if args.tokenizer is None:
        try:
            tokenizer, source = train_bpe(args.train_bpe, texts), f"byte-level BPE of {args.train_bpe} trained on {len(texts)} document(s)"
        except BaseException:
            if not existed:
                args.out.rmdir()
            raise
    tokenizer.save(str(args.out / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    encoded = (e.ids for e in tokenizer.encode_batch(texts))
    meta = write_shards(args.out, encoded, vocab, eos_id(tokenizer), source, args.shard_tokens)
    print(f"{args.out}: {meta['tokens']:,} tokens in {len(meta['shards'])} shard(s) of {meta['dtype']}, vocabulary {vocab} "
          f"(train with data=tokens data.tokens_path={args.out} model.vocab_size={vocab} or more)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
