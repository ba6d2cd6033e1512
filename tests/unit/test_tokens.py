"""Token files and the global sample order (`dream_trainer.data.tokens`): the order is a
property of the run, so every data-parallel layout trains on the same global batches."""

from __future__ import annotations

import numpy as np
import pytest

from dream_trainer.data import GlobalOrder, TokenFile, TokenFileError, split_global_batch, write_tokens


def _docs(n: int = 50, seed: int = 0, high: int = 60000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_token_file_round_trips_tokens_and_documents(tmp_path, dtype):
    docs = _docs(high=60000 if dtype == "uint16" else 2**20)
    tf = TokenFile(write_tokens(tmp_path / "c.tokens", docs, dtype=dtype), dtype=dtype)
    assert tf.n_docs == len(docs) and tf.n_tokens == sum(d.size for d in docs)
    flat = np.concatenate(docs)
    assert np.array_equal(tf.tokens, flat)
    assert np.array_equal(tf.sample(3, 8), flat[24:33])  # window 3 of length 8: 9 tokens
    assert tf.n_samples(8) == (flat.size - 1) // 8
    doc = tf.sample(5, 8, mode="documents", pad_id=7)
    expected = np.full(9, 7)
    expected[:min(9, docs[5].size)] = docs[5][:9]
    assert np.array_equal(doc, expected)


def test_damaged_truncated_and_mismatched_token_files_are_refused_clearly(tmp_path):
    path = write_tokens(tmp_path / "c.tokens", _docs())
    with pytest.raises(TokenFileError, match="holds uint16 tokens, but dtype='uint32' was asked for"):
        TokenFile(path, dtype="uint32")
    data = path.read_bytes()
    (tmp_path / "cut.tokens").write_bytes(data[:-100])
    with pytest.raises(TokenFileError, match="cut.tokens: .* bytes, but its header describes .*: truncated"):
        TokenFile(tmp_path / "cut.tokens")
    (tmp_path / "foreign.tokens").write_bytes(b"\x00" * 64)
    with pytest.raises(TokenFileError, match="not a token file"):
        TokenFile(tmp_path / "foreign.tokens")
    bad = bytearray(data)
    bad[-8:] = np.asarray([1], dtype="<u8").tobytes()  # the last offset no longer ends at n_tokens
    (tmp_path / "bad.tokens").write_bytes(bytes(bad))
    with pytest.raises(TokenFileError, match="damaged document offsets"):
        TokenFile(tmp_path / "bad.tokens")
    with pytest.raises(TokenFileError, match="cannot be read"):
        TokenFile(tmp_path / "missing.tokens")
    with pytest.raises(ValueError, match="outside uint16"):
        write_tokens(tmp_path / "x.tokens", [np.asarray([70000])])


def _union_per_step(world: int, steps: int, seed: int = 3, micro: int | None = None) -> list[np.ndarray]:
    """What all `world` ranks train on in each step, concatenated in rank order."""
    orders = [GlobalOrder(n_samples=100, global_batch_size=16, seed=seed) for _ in range(world)]
    out = []
    for _ in range(steps):
        shares = [np.concatenate(o.step_samples(rank, world, micro)) for rank, o in enumerate(orders)]
        out.append(np.concatenate(shares))
    return out


def test_the_global_batches_are_bitwise_the_same_for_1_2_and_4_ranks():
    one = _union_per_step(1, 20)
    for world, micro in ((2, None), (4, None), (2, 2), (4, 1)):
        assert all(np.array_equal(a, b) for a, b in zip(one, _union_per_step(world, 20, micro=micro), strict=True))
    # Each epoch's batches are distinct samples (100 // 16 = 6 batches per epoch, the rest dropped).
    epoch0 = np.concatenate(one[:6])
    assert len(set(epoch0.tolist())) == 96
    assert not np.array_equal(np.sort(one[6]), np.sort(one[0]))  # epoch 1: a new permutation


def test_a_resume_seeks_to_the_same_samples_whatever_the_world_size():
    run = GlobalOrder(n_samples=100, global_batch_size=16, seed=5)
    for _ in range(9):  # into epoch 1
        run.step_samples(0, 2)
    state = run.state_dict()
    expected = [np.concatenate(run.step_samples(0, 1)) for _ in range(4)]
    for world in (1, 2, 4):
        resumed = [GlobalOrder(n_samples=100, global_batch_size=16) for _ in range(world)]
        for order in resumed:
            order.load_state_dict(state)
        got = [np.concatenate([np.concatenate(o.step_samples(r, world)) for r, o in enumerate(resumed)])
               for _ in range(4)]
        assert all(np.array_equal(a, b) for a, b in zip(expected, got, strict=True)), world
    with pytest.raises(ValueError, match="over 100 samples, this corpus has 90"):
        GlobalOrder(n_samples=90, global_batch_size=16).load_state_dict(state)


def test_a_global_batch_that_cannot_be_split_is_refused_with_the_sizes_that_would_work():
    assert split_global_batch(32, 4) == (8, 1)
    assert split_global_batch(32, 2, micro_batch_size=4) == (4, 4)
    with pytest.raises(ValueError, match=r"cannot be split over 3 data-parallel ranks; .*: \[1, 2, 4, 8, 16, 32\]"):
        split_global_batch(32, 3)
    with pytest.raises(ValueError, match=r"micro_batch_size=3 does not divide the 16 samples .*: \[1, 2, 4, 8, 16\]"):
        split_global_batch(32, 2, micro_batch_size=3)
    with pytest.raises(ValueError, match="between 1 and the 10 samples"):
        GlobalOrder(n_samples=10, global_batch_size=16)


def test_a_text_corpus_becomes_a_token_file_byte_level(tmp_path, capsys):
    from dream_trainer.data.prepare import main

    (tmp_path / "corpus.txt").write_text("héllo world\n\nsecond doc\nstill second\n\n\n", encoding="utf-8")
    assert main([str(tmp_path / "corpus.txt"), str(tmp_path / "c.tokens"), "--eos", "256"]) == 0
    assert "2 documents" in capsys.readouterr().out
    tf = TokenFile(tmp_path / "c.tokens", dtype="uint16")
    first = list("héllo world".encode()) + [256]
    assert tf.tokens[:len(first)].tolist() == first
    assert tf.offsets.tolist() == [0, len(first), len(first) + len("second doc\nstill second".encode()) + 1]
    assert main([str(tmp_path / "corpus.txt"), str(tmp_path / "d.tokens"), "--tokenizer", "nope.json"]) == 2
    assert "use 'bytes' or the path of a local tokenizer.json" in capsys.readouterr().err
