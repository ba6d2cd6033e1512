"""Token files and the global sample order (`dream_trainer.data.tokens`, `.order`): files that
carry their vocabulary and a checksum, written in one pass and verified on demand; an order
that is a property of the run (every data-parallel layout trains on the same global batches),
computed per batch, and a position that knows its data."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest

from dream_trainer.data import GlobalOrder, TokenFile, TokenFileError, split_global_batch, write_tokens
from dream_trainer.data import tokens as tokens_module
from dream_trainer.data.tokens import TokenWriter


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
    with pytest.raises(ValueError, match="document 0 holds id 70000, outside uint16"):
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


# ------------------------------------------------------------------ format 2: vocabulary, checksum, writer
def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_the_header_records_the_vocabulary_and_a_checksum_of_what_follows(tmp_path):
    import xxhash

    docs = _docs(high=300)
    path = write_tokens(tmp_path / "c.tokens", docs, vocab_size=300)
    raw = path.read_bytes()
    head = struct.unpack("<8sIIQQQIIQQ", raw[:64])
    magic, version, itemsize, n_tokens, n_docs, vocab, algorithm, _, checksum, _ = head
    assert (magic, version, itemsize, vocab, algorithm) == (b"DTTOKENS", 2, 2, 300, 1)
    assert (n_tokens, n_docs) == (sum(d.size for d in docs), len(docs))
    assert checksum == xxhash.xxh3_64_intdigest(raw[64:] + raw[:48])  # tokens, offsets, then the header
    tf = TokenFile(path, vocab_size=300, verify=True)
    assert tf.fingerprint() == {"version": 2, "n_tokens": n_tokens, "n_docs": n_docs, "vocab_size": 300,
                                "checksum": f"xxh3_64:{checksum:016x}"}
    assert TokenFile(write_tokens(tmp_path / "d.tokens", [[1, 2], [7]])).vocab_size == 8  # none given: max id + 1
    with pytest.raises(TokenFileError, match="written for a vocabulary of 300, but vocab_size=256 was asked for"):
        TokenFile(path, vocab_size=256)


def test_an_id_outside_the_vocabulary_is_refused_naming_its_document_and_value(tmp_path):
    docs = [[1, 2, 3], [4, 5], [6, 300, 7]]
    with pytest.raises(ValueError, match=r"document 2 holds id 300, outside the vocabulary of 256 \(ids 0..255\)"):
        write_tokens(tmp_path / "c.tokens", docs, vocab_size=256)
    with TokenWriter(tmp_path / "w.tokens", vocab_size=10) as out:
        with pytest.raises(ValueError, match="document 3 holds id -1"):
            out.write(np.asarray([1, 2, 3, 4, -1]), ends=[1, 3, 4])  # three documents end before the -1
        out.add([9])  # nothing of the refused call was written
    assert TokenFile(tmp_path / "w.tokens", verify=True).tokens.tolist() == [9]
    for bad, match in ((70000, "vocab_size=70000"), (0, "vocab_size=0"), (True, "vocab_size=True")):
        with pytest.raises(ValueError, match=match):
            TokenWriter(tmp_path / "x.tokens", vocab_size=bad)
    with pytest.raises(ValueError, match="float64 values; token ids are ints"):
        write_tokens(tmp_path / "x.tokens", [[1.5]])
    assert _leftovers(tmp_path) == [] and not (tmp_path / "c.tokens").exists()


def test_a_writer_that_fails_mid_way_leaves_no_file_and_no_temporary(tmp_path):
    target = tmp_path / "c.tokens"
    target.write_bytes(b"the previous file")

    def docs():
        yield np.arange(100)
        yield np.arange(50)
        raise RuntimeError("the tokenizer broke")

    with pytest.raises(RuntimeError, match="tokenizer broke"):
        write_tokens(target, docs())
    assert target.read_bytes() == b"the previous file" and _leftovers(tmp_path) == []


def test_the_writer_streams_pieces_and_spills_offsets_to_a_side_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens_module, "_OFFSET_BUFFER", 4)  # offsets spill after 4 documents
    docs = _docs(n=37, high=1000)
    with TokenWriter(tmp_path / "c.tokens", vocab_size=1000) as out:
        out.add(docs[0])
        flat = np.concatenate(docs[1:30])
        out.write(flat, ends=np.cumsum([d.size for d in docs[1:30]]))  # 29 documents at once
        for doc in docs[30:]:  # a document in two pieces, the last one ended by close
            out.write(doc[:1])
            out.write(doc[1:], ends=[doc.size - 1] if doc is not docs[-1] else [])
        assert out._side is not None and out._side_path.exists()
    tf = TokenFile(tmp_path / "c.tokens", verify=True)
    assert np.array_equal(tf.tokens, np.concatenate(docs))
    assert tf.offsets.tolist() == np.concatenate([[0], np.cumsum([d.size for d in docs])]).tolist()
    assert _leftovers(tmp_path) == []


def _corpus_256(tmp_path, n_tokens: int = 20_000):
    rng = np.random.default_rng(1)
    flat = rng.integers(0, 256, size=n_tokens)
    return write_tokens(tmp_path / "c.tokens", np.split(flat, [3000, 9000, 14000]), vocab_size=256)


def test_verify_names_the_first_token_outside_the_vocabulary(tmp_path):
    path = _corpus_256(tmp_path)
    TokenFile(path, verify=True)
    data = bytearray(path.read_bytes())
    data[64 + 5000:64 + 7000] = b"\xff" * 2000  # 2,000 bytes: tokens 2500..3499 become 65535
    path.write_bytes(bytes(data))
    tf = TokenFile(path)  # the sizes and offsets are intact: it opens
    with pytest.raises(TokenFileError, match=r"c.tokens: token 2500 is 65535, not below the vocabulary size 256"):
        tf.verify()
    with pytest.raises(TokenFileError, match="token 2500 is 65535"):
        TokenFile(path, verify=True)


def test_verify_catches_a_zeroed_page_by_its_checksum(tmp_path):
    path = _corpus_256(tmp_path)
    data = bytearray(path.read_bytes())
    data[8192:12288] = bytes(4096)  # a zeroed 4 KiB page: every token still in range
    path.write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match=r"c.tokens: checksum mismatch: its contents hash to [0-9a-f]{16} "
                                             r"\(xxh3_64\), its header records [0-9a-f]{16}"):
        TokenFile(path, verify=True)
    (tmp_path / "sub").mkdir()
    header = bytearray(_corpus_256(tmp_path / "sub").read_bytes())
    header[32:40] = struct.pack("<Q", 257)  # the recorded vocabulary changed: the checksum covers the header too
    (tmp_path / "h.tokens").write_bytes(bytes(header))
    with pytest.raises(TokenFileError, match="checksum mismatch"):
        TokenFile(tmp_path / "h.tokens", verify=True)


def test_a_version_1_file_still_opens_but_cannot_be_verified(tmp_path):
    docs = [np.arange(10), np.arange(5) + 100]
    flat, offsets = np.concatenate(docs).astype("<u2"), np.asarray([0, 10, 15], dtype="<u8")
    path = tmp_path / "old.tokens"
    path.write_bytes(struct.pack("<8sIIQQ", b"DTTOKENS", 1, 2, 15, 2) + flat.tobytes() + offsets.tobytes())
    tf = TokenFile(path, dtype="uint16", vocab_size=50_000)  # nothing to compare the vocabulary with
    assert tf.version == 1 and tf.vocab_size is None and np.array_equal(tf.tokens, flat)
    assert tf.sample(0, 4, mode="documents").tolist() == [0, 1, 2, 3, 4]
    assert tf.fingerprint() == {"version": 1, "n_tokens": 15, "n_docs": 2, "vocab_size": None, "checksum": None}
    with pytest.raises(TokenFileError, match="version 1 records no checksum and no vocabulary size"):
        tf.verify()
    path.write_bytes(struct.pack("<8sIIQQ", b"DTTOKENS", 7, 2, 15, 2) + flat.tobytes() + offsets.tobytes())
    with pytest.raises(TokenFileError, match="version 7 .*only versions 1 and 2 are known"):
        TokenFile(path)


# ------------------------------------------------------------------ the computed order
SIZES = sorted({*range(1, 70), 97, 101, 127, 128, 129, 257, 1009, 1024, 1999, 2000,
                *np.random.default_rng(0).integers(70, 2000, size=20).tolist()})


def test_every_epoch_is_a_permutation_for_any_number_of_samples():
    for n in SIZES:
        order = GlobalOrder(n, 1, seed=n)
        for epoch in (0, 1):
            assert np.array_equal(np.sort(order.order(epoch)), np.arange(n)), (n, epoch)
    big = GlobalOrder(10**6, 512, seed=7)
    ids = np.concatenate([big.ids(3, start, min(start + 65536, 10**6)) for start in range(0, 10**6, 65536)])
    assert np.array_equal(np.bincount(ids, minlength=10**6), np.ones(10**6, dtype=np.int64))
    assert not np.array_equal(ids[:1000], np.arange(1000))


def test_the_order_differs_between_epochs_and_seeds_and_is_the_file_order_without_shuffle():
    a, b = GlobalOrder(1000, 10, seed=1), GlobalOrder(1000, 10, seed=2)
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), b.order(0))
    assert np.array_equal(a.order(0), GlobalOrder(1000, 10, seed=1).order(0))  # deterministic
    assert np.array_equal(GlobalOrder(1000, 10, shuffle=False).order(4), np.arange(1000))
    # One epoch's batches, taken one at a time, are its permutation: no id twice, none left out.
    batches = np.concatenate([a.next_global_batch() for _ in range(100)])
    assert np.array_equal(batches, a.order(0)) and a.epoch == 0 and a.consumed == 1000


def test_a_huge_epoch_costs_what_one_global_batch_costs():
    order = GlobalOrder(488_000_000, 512, seed=0)
    tracemalloc.start()
    began = time.perf_counter()
    try:
        batches = [order.next_global_batch().copy() for _ in range(20)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - began < 2.0
    assert peak < 2_000_000, peak  # a materialized permutation would be 3.9 GB
    ids = np.concatenate(batches)
    assert ids.min() >= 0 and ids.max() < 488_000_000 and np.unique(ids).size == ids.size
    assert ids.max() > 400_000_000  # drawn from the whole range


def test_a_position_saved_before_the_computed_order_resumes_in_the_order_it_had():
    """A position without ``order_version`` (saved before): it continues with the
    materialized permutation that run drew, exactly; new positions record version 2."""
    legacy = {"seed": 5, "epoch": 1, "consumed": 32, "n_samples": 100, "global_batch_size": 16, "shuffle": 1}
    order = GlobalOrder(100, 16)
    order.load_state_dict(legacy)
    expected = np.random.default_rng([5, 1]).permutation(100)
    assert np.array_equal(order.next_global_batch(), expected[32:48])
    assert order.state_dict()["order_version"] == 1
    assert np.array_equal(order.next_global_batch(), expected[48:64])
    assert GlobalOrder(100, 16).state_dict()["order_version"] == 2
    with pytest.raises(ValueError, match="order_version=3: known order versions are 1 .* and 2"):
        GlobalOrder(100, 16).load_state_dict({**legacy, "order_version": 3})


# ------------------------------------------------------------------ the position knows its data
def test_a_position_of_other_data_is_refused_unless_allowed(tmp_path):
    a = TokenFile(write_tokens(tmp_path / "a.tokens", [np.arange(100)], vocab_size=256))
    b = TokenFile(write_tokens(tmp_path / "b.tokens", [np.arange(100) + 1], vocab_size=256))  # same sizes
    run = GlobalOrder(10, 2, seed=1, fingerprint=a.fingerprint())
    run.next_global_batch()
    state = run.state_dict()
    assert state["fingerprint"] == a.fingerprint()
    GlobalOrder(10, 2, fingerprint=a.fingerprint()).load_state_dict(state)
    with pytest.raises(ValueError, match=r"of other data \(different checksum\): saved .*xxh3_64:.*this run's .*"
                                         r"allow_different_data=True"):
        GlobalOrder(10, 2, fingerprint=b.fingerprint()).load_state_dict(state)
    allowed = GlobalOrder(10, 2, fingerprint=b.fingerprint(), allow_different_data=True)
    allowed.load_state_dict(state)
    assert allowed.consumed == 2 and allowed.state_dict()["fingerprint"] == b.fingerprint()
    old = {k: v for k, v in state.items() if k != "fingerprint"}  # saved before fingerprints: loads
    GlobalOrder(10, 2, fingerprint=b.fingerprint()).load_state_dict(old)
    v1 = {**a.fingerprint(), "version": 1, "vocab_size": None, "checksum": None}  # only sizes to compare
    GlobalOrder(10, 2, fingerprint=v1).load_state_dict(state)
    with pytest.raises(ValueError, match="different n_tokens"):
        GlobalOrder(10, 2, fingerprint={**v1, "n_tokens": 99}).load_state_dict(state)
    with pytest.raises(ValueError, match="expected a dict"):
        GlobalOrder(10, 2, fingerprint="a.tokens")  # type: ignore[arg-type]
