"""Real data: `python -m src.data.prepare` with a BPE trained by `tokenizers` or a tokenizer.json given,
memory-mapped shards (uint16 and uint32, windows never across a shard's end), a run on them whose
resume from a checkpoint sees the same next batches, and the refusals of a corpus a run cannot use."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

from src.config.compose import ConfigError, compose_config  # noqa: E402
from src.data.batches import TokenBatches  # noqa: E402
from src.data.prepare import main as prepare  # noqa: E402
from src.data.tokens import TokenShards, write_shards  # noqa: E402
from src.runtime import RunContext  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40 + "\n") * 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        (d / f"doc{i}.txt").write_text(f"Document {i}. " + TEXT + "def f(x):\n    return x * 2\n" * (i + 1))
    out = d / "bpe"
    assert prepare(["--train-bpe", "300", "--text", *map(str, sorted(d.glob("doc*.txt"))), "--out", str(out), "--shard-tokens", "700"]) == 0
    return out


def test_prepare_writes_shards_a_tokenizer_and_meta(corpus):
    from tokenizers import Tokenizer

    meta = json.loads((corpus / "meta.json").read_text())
    assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16" and len(meta["shards"]) >= 2 and meta["eos_id"] is not None
    ids = np.concatenate([np.fromfile(corpus / name, dtype=np.uint16) for name, _ in meta["shards"]])
    assert len(ids) == meta["tokens"] == sum(n for _, n in meta["shards"]) and ids.max() < 300
    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    first = ids[: list(ids).index(meta["eos_id"])].tolist()  # the first document, up to its end-of-text
    assert tokenizer.decode(first).startswith("Document 0. The quick brown fox")
    # the same tokenizer.json given back encodes the same ids (a checkpoint's tokenizer, as LLaMA's)
    again = corpus.parent / "again"
    assert prepare(["--tokenizer", str(corpus / "tokenizer.json"), "--text", *map(str, sorted(corpus.parent.glob("doc*.txt"))),
                    "--out", str(again), "--shard-tokens", "700"]) == 0
    assert json.loads((again / "meta.json").read_text())["shards"] == meta["shards"]


def test_windows_are_read_from_their_own_shard_in_either_dtype(tmp_path):
    docs = [list(range(10)), list(range(100, 107))]
    for vocab, dtype in ((300, np.uint16), (70000, np.uint32)):
        meta = write_shards(tmp_path / str(vocab), iter(docs), vocab, eos_id=vocab - 1, tokenizer="test", shard_tokens=8)
        assert meta["dtype"] == np.dtype(dtype).name
        shards = TokenShards(tmp_path / str(vocab), window=4)
        flat = [t for d in docs for t in (*d, vocab - 1)]  # 19 tokens in shards of 8, 8, 3
        assert [n for _, n in meta["shards"]] == [8, 8, 3] and shards.windows == 5 + 5 + 0
        windows = [shards.read(i).tolist() for i in range(shards.windows)]
        assert windows[0] == flat[0:4] and windows[4] == flat[4:8] and windows[5] == flat[8:12]


def test_a_run_on_tokens_resumes_at_the_same_batch(tmp_path, corpus, in_process_runs):
    """4 steps straight against 2 steps, a checkpoint, and 2 more resumed: the same fp32 losses on the
    steps after the checkpoint, because the batch of a step is drawn by (seed, step)."""
    from src.train.worker import train

    common = ["model=llama3_tiny", "model.vocab_size=300", "data=tokens", f"data.tokens_path={corpus}", "data.seq_len=32",
              "data.batch_size=2", "dist.nproc=1", "precision=fp32", "tracking=none", "train.progress=false",
              "checkpoint.enabled=true", "checkpoint.interval=2"]

    def run(name: str, steps: int, extra=()) -> list[float]:
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        train(compose_config([*common, f"train.steps={steps}", f"checkpoint.folder={tmp_path / name / 'ck'}", *extra]),
              RunContext(run_dir=str(d), cwd=str(tmp_path)))
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]

    straight = run("straight", 4)
    first = run("first", 2)
    resumed = run("resumed", 4, [f"checkpoint.resume={tmp_path / 'first' / 'ck' / 'step_00000002'}"])
    assert first == straight[:2] and resumed[-2:] == straight[2:]
    batches = TokenBatches("tokens", 300, 2, 32, 0, tokens_path=str(corpus))
    batches.step = 3
    x, y = next(batches)
    assert x.dtype == torch.int64 and x.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_a_corpus_the_run_cannot_use_is_refused_in_one_line(tmp_path, corpus):
    from src.config.validate import validate

    def refused(overrides: list[str]) -> str:
        with pytest.raises(ConfigError) as err:
            validate(compose_config(overrides), cuda_device_count=0, mps_available=False)
        return str(err.value)

    assert refused(["data=tokens"]) == "data=tokens reads a corpus python -m src.data.prepare made: set data.tokens_path=DIR"
    assert refused(["data=tokens", f"data.tokens_path={tmp_path}"]).startswith(f"data.tokens_path={tmp_path}: no meta.json there")
    top = max(json.loads((corpus / "meta.json").read_text())["max_ids"])
    assert 256 <= top < 300
    assert refused(["data=tokens", f"data.tokens_path={corpus}", "model=llama3_tiny", "data.seq_len=32"]) == (
        f"data.tokens_path={corpus} holds token ids up to {top} (meta.json's max_ids), and model.vocab_size=256: "
        f"set model.vocab_size={top + 1} or more")
    assert "no shard holds 100001 tokens" in refused(["data=tokens", f"data.tokens_path={corpus}", "model.vocab_size=300", "data.seq_len=100000"])


def _copy(corpus: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(corpus, to)
    return to


def test_shards_that_are_not_what_meta_json_says_are_refused_before_any_rank(tmp_path, corpus):
    """A shard written as uint32 where meta.json says uint16 would train on every second token 0; a
    cut-off shard or meta.json, a shard that is missing: each one line naming the file."""
    from src.config.validate import validate

    def refused(folder: Path) -> str:
        with pytest.raises(ConfigError) as err:
            validate(compose_config(["data=tokens", f"data.tokens_path={folder}", "model.vocab_size=300", "data.seq_len=32"]),
                     cuda_device_count=0, mps_available=False)
        assert "\n" not in str(err.value)
        return str(err.value)

    meta = json.loads((corpus / "meta.json").read_text())
    name, n = meta["shards"][0]
    wide = _copy(corpus, tmp_path / "wide")
    np.fromfile(corpus / name, dtype=np.uint16).astype(np.uint32).tofile(wide / name)
    assert f"{name} holds {4 * n:,} bytes where meta.json says {n:,} uint16 tokens ({2 * n:,} bytes)" in refused(wide)
    cut = _copy(corpus, tmp_path / "cut")
    (cut / name).write_bytes((corpus / name).read_bytes()[:-7])
    assert f"{name} holds {2 * n - 7:,} bytes" in refused(cut)
    gone = _copy(corpus, tmp_path / "gone")
    (gone / name).unlink()
    assert f"meta.json lists {name}, which is not there" in refused(gone)
    bad = _copy(corpus, tmp_path / "bad")
    (bad / "meta.json").write_text((corpus / "meta.json").read_text()[:40])
    assert "meta.json is cut off or not JSON" in refused(bad)


@pytest.mark.parametrize("make, args, said", [
    (lambda p: p.write_text(""), [], "no text in it"),
    (lambda p: p.write_bytes(b"\x7fELF\x02\x01\x01\x00" * 64), [], "a binary file (it holds NUL bytes), not text"),
    (lambda p: p.write_bytes("café au lait".encode("latin1")), [], "not UTF-8 (byte 3: b'\\xe9')"),
    (lambda p: p.write_text("some text " * 50), ["--shard-tokens", "0"], "--shard-tokens 0: a shard holds at least 1 token"),
])
def test_prepare_refuses_what_it_cannot_tokenize_in_one_line_and_writes_nothing(make, args, said, tmp_path, capsys):
    text = tmp_path / "in.txt"
    make(text)
    assert prepare(["--train-bpe", "300", "--text", str(text), "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_prepare_names_an_out_folder_it_cannot_write(tmp_path, capsys):
    import os

    text = tmp_path / "in.txt"
    text.write_text("some text " * 50)
    (tmp_path / "file").write_text("")
    assert prepare(["--train-bpe", "300", "--text", str(text), "--out", str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {tmp_path / 'file' / 'out'}: cannot write there") and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["file", "in.txt"]  # nothing new beside the inputs


def test_prepare_names_a_tokenizer_file_it_cannot_read_and_leaves_no_folder(tmp_path, capsys):
    text, bad = tmp_path / "in.txt", tmp_path / "tokenizer.json"
    text.write_text("some text " * 50)
    bad.write_text("not json")
    assert prepare(["--tokenizer", str(bad), "--text", str(text), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer {bad}: not a tokenizers file") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
