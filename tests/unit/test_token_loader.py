"""`TokenLoader`: the run's global batches split over any data-parallel size, a position
that is the same on every rank and loads into another world size, and the trainer's
``global_batch_size`` (the accumulation derived from the data-parallel size)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dream_trainer.data import TokenDataset, TokenFile, TokenLoader, write_tokens

SEQ = 8


@pytest.fixture()
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=int(rng.integers(5, 60))) for _ in range(120)]
    return write_tokens(tmp_path / "c.tokens", docs)


def _steps(loaders: list[TokenLoader], steps: int) -> list[list[np.ndarray]]:
    """Per optimizer step, the sample ids of every rank's micro-batches (rank order)."""
    iterators = [iter(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        out.append([batch[2].numpy() for it, loader in zip(iterators, loaders)
                    for batch in (next(it) for _ in range(loader.accumulation_steps))])
    return out


@pytest.mark.parametrize(("dp_size", "micro"), [(1, None), (1, 4), (2, None), (2, 2), (4, None), (4, 1)])
def test_every_layout_trains_on_the_same_global_batches_in_the_same_order(corpus, dp_size, micro):
    single = _steps([TokenLoader(corpus, SEQ, 16, seed=3, return_ids=True)], 12)
    loaders = [TokenLoader(corpus, SEQ, 16, dp_rank=r, dp_size=dp_size, micro_batch_size=micro, seed=3,
                           return_ids=True) for r in range(dp_size)]
    assert loaders[0].accumulation_steps == 16 // dp_size // (micro or 16 // dp_size)
    split = _steps(loaders, 12)
    for whole, parts in zip(single, split):
        assert np.array_equal(np.concatenate(whole), np.concatenate(parts))  # bitwise: the same ids, same order
    # and the tokens are the file's: sample i is window i of the stream
    tf, (x, y, ids) = TokenFile(corpus), next(iter(loaders[-1]))
    for row, i in zip(range(len(ids)), ids.tolist()):
        window = torch.from_numpy(tf.sample(i, SEQ))
        assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])


def test_a_position_saved_with_two_ranks_resumes_with_one_and_back(corpus):
    uninterrupted = _steps([TokenLoader(corpus, SEQ, 16, seed=1, return_ids=True)], 20)
    two = [TokenLoader(corpus, SEQ, 16, dp_rank=r, dp_size=2, seed=1, return_ids=True) for r in range(2)]
    first = _steps(two, 7)
    states = [loader.state_dict() for loader in two]
    assert states[0] == states[1]  # one position for the run, whatever the rank
    one = TokenLoader(corpus, SEQ, 16, micro_batch_size=4, seed=1, return_ids=True)
    one.load_state_dict(states[0])
    middle = _steps([one], 6)
    again = [TokenLoader(corpus, SEQ, 16, dp_rank=r, dp_size=2, seed=1, return_ids=True) for r in range(2)]
    for loader in again:
        loader.load_state_dict(one.state_dict())
    last = _steps(again, 7)
    resumed = [np.concatenate(s) for s in first + middle + last]
    assert all(np.array_equal(a, np.concatenate(b)) for a, b in zip(resumed, uninterrupted))


def test_epochs_turn_over_and_the_length_counts_micro_batches(corpus):
    loader = TokenLoader(corpus, SEQ, 16, dp_rank=1, dp_size=2, micro_batch_size=4, seed=0, return_ids=True)
    assert len(loader) == loader.steps_per_epoch * 2
    epoch0 = [b[2] for b in loader]
    assert len(epoch0) == len(loader) and loader.order.epoch == 0 and not loader.order.has_batch()
    epoch1 = [b[2] for b in loader]  # a new iterator: the next epoch, another permutation
    assert loader.order.epoch == 1 and len(epoch1) == len(epoch0)
    assert not torch.equal(torch.cat(epoch0), torch.cat(epoch1))
    loader.set_epoch(1)  # the cursor is in epoch 1 already: no change
    assert loader.order.epoch == 1 and loader.order.consumed == loader.steps_per_epoch * 16
    loader.set_epoch(4)
    assert (loader.order.epoch, loader.order.consumed) == (4, 0)


def test_positions_that_cannot_be_resumed_are_refused(corpus, tmp_path):
    loader = TokenLoader(corpus, SEQ, 16, micro_batch_size=4)
    it = iter(loader)
    next(it)  # one micro-batch into a step of 4
    state = loader.state_dict()
    assert state["micro"] == 1
    with pytest.raises(ValueError, match="1 micro-batch.* into a step of 4, but this run accumulates 2"):
        TokenLoader(corpus, SEQ, 16, micro_batch_size=8).load_state_dict(state)
    other = write_tokens(tmp_path / "other.tokens", [np.arange(300)])
    with pytest.raises(ValueError, match="not the same data"):
        TokenLoader(other, SEQ, 16).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size=16 cannot be split over 3 data-parallel ranks.*"
                                         r"\[1, 2, 4, 8, 16\]"):
        TokenLoader(corpus, SEQ, 16, dp_rank=0, dp_size=3)
    with pytest.raises(ValueError, match="more than the .* samples"):
        TokenLoader(other, SEQ, 64)


def test_the_dataset_gives_the_loaders_samples(corpus):
    data, tf = TokenDataset(corpus, SEQ), TokenFile(corpus)
    assert len(data) == tf.n_samples(SEQ)
    x, y = data[5]
    assert torch.equal(torch.cat([x, y[-1:]]), torch.from_numpy(tf.sample(5, SEQ)))
    with pytest.raises(IndexError):
        data[len(data)]


def test_documents_are_samples_too(corpus):
    """One document per sample, cropped or padded: the inputs padded with pad_id, the targets
    at padding -100 (the loss skips them; tests/unit/test_documents.py checks the loss)."""
    tf = TokenFile(corpus)
    loaders = [TokenLoader(corpus, SEQ, 8, dp_rank=r, dp_size=2, mode="documents", pad_id=7, return_ids=True)
               for r in range(2)]
    assert loaders[0].order.n_samples == tf.n_docs
    padded, masked, seen = 0, 0, set()
    for x, y, ids in (batch for loader in loaders for batch in loader):  # an epoch: every document once
        for row, i in enumerate(ids.tolist()):
            doc = torch.from_numpy(tf.sample(i, SEQ, mode="documents", pad_id=7))
            n = int(tf.offsets[i + 1] - tf.offsets[i])  # the document's length
            assert torch.equal(x[row], doc[:-1])
            assert torch.equal(y[row, :n - 1], doc[1:n]) and bool((y[row, n - 1:] == -100).all())
            padded += max(SEQ + 1 - n, 0)
            seen.add(i)
        masked += int((y == -100).sum())
    assert len(seen) == tf.n_docs and padded and masked == padded  # some were padded, none trains on padding


def test_a_resume_on_other_data_of_the_same_size_is_refused_unless_allowed(corpus, tmp_path):
    """The saved position records the file's fingerprint: a file with as many samples but other
    tokens (one id changed) is refused, naming the checksum; `allow_different_data` lets it go
    on from the same position."""
    loader = TokenLoader(corpus, SEQ, 16, micro_batch_size=4)
    for _, _ in zip(range(8), loader):  # two steps
        pass
    state = loader.state_dict()
    assert state["order"]["fingerprint"] == TokenFile(corpus).fingerprint()
    source = TokenFile(corpus)
    tokens = np.array(source.tokens)
    tokens[7] = (tokens[7] + 1) % 500
    docs = [tokens[int(a):int(b)] for a, b in zip(source.offsets[:-1], source.offsets[1:])]
    other = write_tokens(tmp_path / "edited.tokens", docs, vocab_size=source.vocab_size)
    assert TokenFile(other).n_tokens == source.n_tokens
    with pytest.raises(ValueError, match="checksum"):
        TokenLoader(other, SEQ, 16, micro_batch_size=4).load_state_dict(state)
    allowed = TokenLoader(other, SEQ, 16, micro_batch_size=4, allow_different_data=True)
    allowed.load_state_dict(state)
    assert allowed.order.consumed == loader.order.consumed == 32


def _pairs(loader: TokenLoader, n: int) -> list[tuple[np.ndarray, dict]]:
    """The first `n` micro-batches (across epochs) and the loader's position after each."""
    out: list[tuple[np.ndarray, dict]] = []
    while len(out) < n:
        for batch in loader:
            out.append((batch[2].numpy().copy(), loader.state_dict()))
            if len(out) == n:
                break
    return out


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_read_ahead_hands_out_the_same_batches_and_positions(corpus, dp_rank):
    """prefetch=3 (a background thread reading ahead) gives the same micro-batches and, after
    each, the same saved position as reading in the step, over epoch ends, with accumulation;
    a loop stopped early leaves the cursor where it stopped (reads ahead are not consumed) and
    its reading thread ends."""
    import threading

    kwargs = dict(micro_batch_size=8, dp_rank=dp_rank, dp_size=2, return_ids=True)
    plain = TokenLoader(corpus, SEQ, 64, **kwargs)
    ahead = TokenLoader(corpus, SEQ, 64, prefetch=3, **kwargs)
    assert plain.prefetch == 0 and plain.steps_per_epoch * plain.accumulation_steps < 40  # epochs turn over
    for (a, sa), (b, sb) in zip(_pairs(plain, 40), _pairs(ahead, 40), strict=True):
        assert np.array_equal(a, b) and sa == sb
    stopped = TokenLoader(corpus, SEQ, 64, prefetch=3, **kwargs)
    it = iter(stopped)
    first = [next(it)[2] for _ in range(6)]  # a step and a half (4 micro-batches a step)
    assert stopped.state_dict()["micro"] == 2
    it.close()
    resumed = TokenLoader(corpus, SEQ, 64, **kwargs)
    resumed.load_state_dict(stopped.state_dict())
    expected = _pairs(TokenLoader(corpus, SEQ, 64, **kwargs), 7)
    assert np.array_equal(next(iter(resumed))[2], expected[6][0]) and np.array_equal(first[5], expected[5][0])
    assert not [t for t in threading.enumerate() if t.name.startswith("TokenLoader-prefetch")]
    with pytest.raises(ValueError, match=r"prefetch=-1.*int >= 0"):
        TokenLoader(corpus, SEQ, 8, prefetch=-1)
