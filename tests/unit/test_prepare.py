"""`python -m dream_trainer.data.prepare`: text to token files, streaming (documents cut on
the fly, whatever the read size), in parallel shards that merge into what one worker writes,
resumable (a complete, verified shard is kept), and `--verify` for files and shard indexes."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import numpy as np
import pytest

from dream_trainer.data import TokenFile
from dream_trainer.data.prepare import documents, iter_documents, main, merge_shards, prepare, prepare_shards, verify


def _text(n_paragraphs: int = 400, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["alpha", "béta", "gamma", "δelta", "eps", "zeta\t", "η"]
    paragraphs = ["\n".join(" ".join(rng.choice(words, size=int(rng.integers(1, 12))))
                            for _ in range(int(rng.integers(1, 5)))) for _ in range(n_paragraphs)]
    seps = rng.choice(["\n\n", "\n\n\n", "\n \n\n", "\r\n\r\n"], size=n_paragraphs)
    return "".join(p + s for p, s in zip(paragraphs, seps))


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(_text().encode("utf-8"))
    return path


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_a_text_corpus_becomes_a_token_file_byte_level(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("héllo world\n\nsecond doc\nstill second\n\n\n", encoding="utf-8")
    assert main([str(tmp_path / "corpus.txt"), str(tmp_path / "c.tokens"), "--eos", "256"]) == 0
    out = capsys.readouterr().out
    assert "2 documents" in out and "vocabulary 257" in out and "tokens/s" in out
    tf = TokenFile(tmp_path / "c.tokens", dtype="uint16", vocab_size=257, verify=True)
    first = list("héllo world".encode()) + [256]
    assert tf.tokens[:len(first)].tolist() == first
    assert tf.offsets.tolist() == [0, len(first), len(first) + len("second doc\nstill second".encode()) + 1]
    assert main([str(tmp_path / "corpus.txt"), str(tmp_path / "d.tokens"), "--tokenizer", "nope.json"]) == 2
    assert "use 'bytes' or the path of a local tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("split", ["paragraphs", "lines"])
def test_documents_cut_while_streaming_are_those_of_the_whole_text(tmp_path, split):
    rng = np.random.default_rng(3)
    for trial in range(30):
        text = "".join(rng.choice(["a", "b", " ", "\n", "\n", "\r\n", "é", "\u2028"], size=int(rng.integers(0, 80))))
        path = tmp_path / f"t{trial}.txt"
        path.write_bytes(text.encode("utf-8"))
        whole = list(documents(path.read_text(encoding="utf-8"), split))
        for read_chars in (1, 2, 3, 7, 1000):
            assert list(iter_documents(path, split, read_chars=read_chars)) == whole, (text, read_chars)


def _concat(paths) -> tuple[np.ndarray, np.ndarray]:
    files = [TokenFile(p, verify=True) for p in paths]
    tokens = np.concatenate([np.asarray(f.tokens) for f in files])
    bases = np.cumsum([0] + [f.n_tokens for f in files])
    offsets = np.concatenate([[0]] + [np.asarray(f.offsets[1:]) + base for f, base in zip(files, bases)])
    return tokens, offsets


def test_two_workers_write_shards_that_together_are_what_one_worker_writes(tmp_path, corpus, capsys):
    one = prepare(corpus, tmp_path / "one.tokens", eos=0)
    two = prepare(corpus, tmp_path / "two.tokens", eos=0, workers=2, shards=3, log=print)
    out = capsys.readouterr().out
    assert out.count("tokens/s") == 4 and "3 shard(s) by 2 worker(s)" in out and "per worker" in out
    assert one.n_docs == len(list(documents(corpus.read_text(encoding="utf-8")))) > 300
    assert np.array_equal(one.tokens, two.tokens) and np.array_equal(one.offsets, two.offsets)
    assert (tmp_path / "two.tokens").read_bytes() == (tmp_path / "one.tokens").read_bytes()  # same checksum too
    index = json.loads((tmp_path / "two.index.json").read_text())
    names = [s["path"] for s in index["shards"]]
    assert names == [f"two-{i:05d}-of-00003.tokens" for i in range(3)] and index["complete"]
    tokens, offsets = _concat([tmp_path / n for n in names])
    assert np.array_equal(tokens, one.tokens) and np.array_equal(offsets, one.offsets)
    assert index["n_tokens"] == one.n_tokens and index["merged"]["fingerprint"] == two.fingerprint()
    assert _leftovers(tmp_path) == []


def test_a_rerun_keeps_the_complete_shards_and_redoes_the_rest(tmp_path, corpus, capsys):
    index = prepare_shards(corpus, tmp_path / "c.tokens", shards=3, log=print)
    shards = [tmp_path / s["path"] for s in json.loads(index.read_text())["shards"]]
    before = [p.stat() for p in shards]
    expected = _concat(shards)
    shards[1].unlink()  # interrupted before shard 2 was renamed into place
    data = bytearray(shards[2].read_bytes())
    data[100:200] = bytes(100)  # shard 3 damaged
    shards[2].write_bytes(bytes(data))
    capsys.readouterr()
    prepare_shards(corpus, tmp_path / "c.tokens", shards=3, log=print)
    out = capsys.readouterr().out
    assert "shard 1/3 c-00000-of-00003.tokens: already complete (verified), kept" in out
    assert out.count("kept") == 1 and out.count("tokens/s") == 3  # shards 2 and 3, and the total
    after = shards[0].stat()
    assert (after.st_ino, after.st_mtime_ns) == (before[0].st_ino, before[0].st_mtime_ns)  # not rewritten
    assert all(np.array_equal(a, b) for a, b in zip(_concat(shards), expected))
    prepare_shards(corpus, tmp_path / "c.tokens", shards=3, eos=1, log=print)  # another option: all redone
    assert "every shard is written again" in capsys.readouterr().out
    merged = merge_shards(index, tmp_path / "c.tokens")
    assert merged.vocab_size == 256 and merged.n_docs == expected[1].size - 1
    assert _leftovers(tmp_path) == []


def test_verify_checks_a_file_or_an_index_and_all_its_shards(tmp_path, corpus, capsys):
    prepare(corpus, tmp_path / "c.tokens", shards=2)
    assert main(["--verify", str(tmp_path / "c.tokens")]) == 0
    assert "verified" in capsys.readouterr().out
    assert "3 files" in verify(tmp_path / "c.index.json")
    shard = tmp_path / "c-00001-of-00002.tokens"
    data = bytearray(shard.read_bytes())
    data[64:2064] = b"\xff" * 2000
    shard.write_bytes(bytes(data))
    assert main(["--verify", str(tmp_path / "c.index.json")]) == 1
    assert "c-00001-of-00002.tokens: token 0 is 65535, not below the vocabulary size 256" in capsys.readouterr().err
    (tmp_path / "junk.tokens").write_bytes(b"not tokens")
    assert main(["--verify", str(tmp_path / "junk.tokens")]) == 1
    assert "not a token file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--verify", str(shard), str(corpus)])


def test_a_failing_worker_stops_the_run_and_leaves_no_temporary(tmp_path, capsys):
    source = tmp_path / "bad.txt"
    good = _text(200).encode("utf-8")
    source.write_bytes(good + b"\n\nbroken \xff\xfe text\n\n" + good)
    assert main([str(source), str(tmp_path / "c.tokens"), "--workers", "2"]) == 2
    assert "bad.txt: not UTF-8 text" in capsys.readouterr().err
    assert _leftovers(tmp_path) == [] and not (tmp_path / "c.tokens").exists()


def test_a_tokenizer_json_gives_its_vocabulary_and_ids(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "alpha": 1, "gamma": 2, "eps": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("alpha gamma\n\neps zzz alpha\n", encoding="utf-8")
    tf = prepare(tmp_path / "c.txt", tmp_path / "c.tokens", tokenizer=str(tmp_path / "tokenizer.json"), eos=9)
    assert tf.vocab_size == 10 and tf.tokens.tolist() == [1, 2, 9, 3, 0, 1, 9] and tf.offsets.tolist() == [0, 3, 7]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a named pipe")
def test_a_worker_terminated_mid_shard_removes_its_temporary_files(tmp_path):
    """A pool worker stopped by SIGTERM (what ``Pool.terminate`` sends when another shard
    fails) while it writes: its temporary files go with it."""
    from dream_trainer.data.prepare import _tokenize, _worker_init

    source = tmp_path / "pipe.txt"
    os.mkfifo(source)  # opening it blocks: the worker waits with its writer's temporary file open
    job = {"shard": 0, "path": str(tmp_path / "c.tokens"), "source": str(source), "start": 0, "end": None,
           "tokenizer": "bytes", "split": "paragraphs", "eos": None, "dtype": "uint16", "vocab_size": 256}
    pool = multiprocessing.get_context("fork").Pool(1, initializer=_worker_init)
    try:
        pool.apply_async(_tokenize, (job,))
        deadline = time.monotonic() + 30
        while not _leftovers(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _leftovers(tmp_path), "the worker never started writing"
    finally:
        pool.terminate()
        pool.join()
    assert _leftovers(tmp_path) == [] and not (tmp_path / "c.tokens").exists()


def test_a_writer_knows_its_temporary_files(tmp_path):
    from dream_trainer.data.tokens import TokenWriter

    out = TokenWriter(tmp_path / "c.tokens")
    assert TokenWriter.temporary_files(tmp_path / "c.tokens") == [out._tmp]
    assert TokenWriter.temporary_files(tmp_path / "c.tokens", pid=os.getpid() + 1) == []
    out.abort()
    assert TokenWriter.temporary_files(tmp_path / "c.tokens") == [] and _leftovers(tmp_path) == []
