"""Blends (`dream_trainer.data.blend`): several token files mixed by weight, with exact
per-source counts, the same global batches on any world size, and a position that resumes
on another one."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from dream_trainer.data import TokenBlend, TokenFile, TokenLoader, apportion, write_tokens

SEQ = 8


def _file(path, n_docs, seed, length=40):
    rng = np.random.default_rng(seed)
    return write_tokens(path, [rng.integers(0, 500, size=length) for _ in range(n_docs)])


@pytest.fixture()
def files(tmp_path):
    """small: 49 windows of 8 tokens; big: 499; mid: 149."""
    return {"small": _file(tmp_path / "small.tokens", 10, 0), "big": _file(tmp_path / "big.tokens", 100, 1),
            "mid": _file(tmp_path / "mid.tokens", 30, 2)}


def _blend(files, **weights):
    return {name: (files[name], weight) for name, weight in weights.items()}


def _steps(loaders, steps):
    """Per step, the ``(source, id)`` rows of all ranks' micro-batches, in rank order."""
    iterators = [iter(loader) for loader in loaders]
    return [np.concatenate([next(it)[2].numpy() for it, loader in zip(iterators, loaders)
                            for _ in range(loader.accumulation_steps)]) for _ in range(steps)]


def _reference(t, G, weights):
    """Largest remainder of t*G by `weights` (Fractions), written independently."""
    quotas = [Fraction(t * G) * w / sum(weights) for w in weights]
    counts = [q.numerator // q.denominator for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:t * G - sum(counts)]:
        counts[i] += 1
    return counts


def test_per_source_counts_are_the_apportionment_and_match_the_samples_read(files):
    weights = {"small": 0.37, "big": 0.41, "mid": 0.22}
    loader = TokenLoader(_blend(files, **weights), SEQ, 10, micro_batch_size=5, seed=4, return_ids=True)
    taken = np.zeros(3, dtype=int)
    exact = [Fraction(str(w)) for w in weights.values()]
    iterator = iter(loader)
    for t in range(1, 24):
        rows = np.concatenate([next(iterator)[2].numpy() for _ in range(loader.accumulation_steps)])
        step = np.bincount(rows[:, 0], minlength=3)
        assert step.min() >= 1  # every source in every global batch
        taken += step
        counts = loader.source_counts()
        assert list(counts) == ["small", "big", "mid"]
        assert list(counts.values()) == taken.tolist() == _reference(t, 10, exact)
        for c, w in zip(taken, weights.values()):
            assert abs(c - t * 10 * w) < 1  # never a whole sample off the weights
    assert loader.log_metrics()["data/samples/mid"] == float(taken[2])
    assert loader.log_metrics()["data/epochs/small"] == pytest.approx(taken[0] / 49)
    # with 3 sources the largest remainder can lower a count as the total grows: the blend refuses
    # weights under 1/G, above which it cannot
    for t in range(200):
        assert all(b >= a for a, b in zip(apportion(t * 10, [37, 41, 22]), apportion((t + 1) * 10, [37, 41, 22])))


def test_the_samples_are_the_sources_tokens_and_two_loaders_agree(files):
    def make():
        return TokenLoader(_blend(files, small=1, big=3), SEQ, 16, dp_rank=1, dp_size=2, seed=7, return_ids=True,
                           prefetch=2)
    first, second = iter(make()), iter(make())
    opened = {0: TokenFile(files["small"]), 1: TokenFile(files["big"])}
    for _ in range(5):
        (x, y, ids), (x2, y2, ids2) = next(first), next(second)
        assert torch.equal(ids, ids2) and torch.equal(x, x2) and torch.equal(y, y2)
        assert ids.shape == (8, 2) and set(ids[:, 0].tolist()) <= {0, 1}
        for row, (source, i) in enumerate(ids.tolist()):
            window = torch.from_numpy(opened[source].sample(i, SEQ))
            assert torch.equal(x[row], window[:-1]) and torch.equal(y[row], window[1:])
    other_seed = TokenLoader(_blend(files, small=1, big=3), SEQ, 16, dp_rank=1, dp_size=2, seed=8, return_ids=True)
    assert not torch.equal(next(iter(other_seed))[2], next(iter(make()))[2])


@pytest.mark.parametrize(("dp_size", "micro"), [(2, None), (2, 2), (4, 1)])
def test_every_world_size_takes_the_same_global_batches(files, dp_size, micro):
    blend = _blend(files, small=0.6, big=0.25, mid=0.15)
    single = _steps([TokenLoader(blend, SEQ, 16, seed=2, return_ids=True)], 9)
    split = _steps([TokenLoader(blend, SEQ, 16, dp_rank=r, dp_size=dp_size, micro_batch_size=micro, seed=2,
                                return_ids=True) for r in range(dp_size)], 9)
    for whole, parts in zip(single, split):
        assert np.array_equal(whole, parts)
    assert len(np.unique(single[0][:, 0])) == 3  # the global batch mixes the sources ...
    assert len(np.unique(single[0][:8, 0])) > 1  # ... and so does a rank's share of it


def test_a_position_resumes_on_another_world_size(files):
    blend = _blend(files, small=0.7, big=0.3)
    uninterrupted = _steps([TokenLoader(blend, SEQ, 16, seed=5, return_ids=True)], 30)
    two = [TokenLoader(blend, SEQ, 16, dp_rank=r, dp_size=2, seed=5, return_ids=True) for r in range(2)]
    first = _steps(two, 11)
    state = two[0].state_dict()
    assert state == two[1].state_dict() and state["order"]["steps"] == 11
    four = [TokenLoader(blend, SEQ, 16, dp_rank=r, dp_size=4, seed=0, return_ids=True) for r in range(4)]
    for loader in four:
        loader.load_state_dict(state)  # the saved seed is the run's
    assert four[0].source_counts() == two[0].source_counts()
    rest = _steps(four, 19)
    for a, b in zip(uninterrupted, first + rest):
        assert np.array_equal(a, b)


def test_a_small_source_repeats_every_sample_once_per_its_epoch(files):
    loader = TokenLoader(_blend(files, small=0.7, big=0.3), SEQ, 16, seed=1, return_ids=True)
    rows = np.concatenate(_steps([loader], 12))  # small: 134 samples of 49, about 2.7 epochs
    small, big = rows[rows[:, 0] == 0, 1], rows[rows[:, 0] == 1, 1]
    taken = loader.source_counts()["small"]
    assert len(small) == taken and taken > 2 * 49
    seen = np.bincount(small, minlength=49)
    epochs, extra = divmod(taken, 49)
    assert set(seen.tolist()) <= {epochs, epochs + 1} and (seen == epochs + 1).sum() == extra
    assert len(np.unique(big)) == len(big)  # the big one is in its first epoch: no sample twice
    assert loader.log_metrics()["data/epochs/small"] == pytest.approx(taken / 49)


def test_nominal_epochs_len_and_set_epoch(files):
    loader = TokenLoader(_blend(files, small=1, big=1), SEQ, 16, micro_batch_size=8, seed=3, return_ids=True)
    assert loader.steps_per_epoch == (49 + 499) // 16 and len(loader) == loader.steps_per_epoch * 2
    epoch = list(iter(loader))
    assert len(epoch) == len(loader) and loader.order.epoch == 1
    loader.set_epoch(1)  # the cursor is in it already: nothing moves
    assert loader.state_dict()["order"]["steps"] == loader.steps_per_epoch
    second = next(iter(loader))[2]
    jumped = TokenLoader(_blend(files, small=1, big=1), SEQ, 16, micro_batch_size=8, seed=3, return_ids=True)
    jumped.set_epoch(1)
    assert torch.equal(next(iter(jumped))[2], second)


def test_documents_mode_and_document_info_read_each_source(files):
    loader = TokenLoader(_blend(files, small=1, mid=1), SEQ, 8, mode="documents", document_info=True,
                         return_ids=True, seed=0)
    batch = next(iter(loader))
    assert batch.inputs.shape == (8, SEQ) and batch.sample_ids.shape == (8, 2)
    opened = [TokenFile(files["small"]), TokenFile(files["mid"])]
    for row, (source, doc) in enumerate(batch.sample_ids.tolist()):
        document = opened[source].sample(doc, SEQ, "documents")[:SEQ].astype(np.int64)
        assert torch.equal(batch.inputs[row], torch.from_numpy(document))
        assert set(batch.document_ids[row].tolist()) == {doc}


def test_the_quorum_slots_split_the_blends_global_batch(files):
    loader = TokenLoader(_blend(files, small=1, big=2), SEQ, 12, seed=0, return_ids=True)
    parts = [loader._quorum_ids(5, replica, 0) for replica in range(5)]
    assert np.array_equal(np.concatenate([ids for ids, _ in parts]), loader.order.peek())
    assert {weight for _, weight in parts} == {2 * 5 / 12, 3 * 5 / 12}


@pytest.mark.parametrize(("sources", "message"), [
    ([], "no sources"),
    ({"a": ("small", 0)}, "weights must be > 0"),
    ({"a": ("small", -0.5)}, "weights must be > 0"),
    ({"a": ("small", float("nan"))}, "finite"),
    ({"a": ("small", True)}, "expected a number"),
    ({"a": "small"}, r"expected a \(file, weight\) pair"),
    ({"a": ("small", 1), "b": ("big", 1000)}, "at least one sample per global batch"),
    ({"a": ("tiny", 1), "b": ("big", 1)}, r"source\(s\) \['a'\] have no samples"),
])
def test_bad_blends_are_refused(files, tmp_path, sources, message):
    files["tiny"] = write_tokens(tmp_path / "tiny.tokens", [[1, 2, 3]])
    if isinstance(sources, dict):
        sources = {k: (files[v[0]], v[1]) if isinstance(v, tuple) else v for k, v in sources.items()}
    with pytest.raises(ValueError, match=message):
        TokenLoader(sources, SEQ, 16)


def test_two_sources_of_one_name_are_refused(files, tmp_path):
    (tmp_path / "other").mkdir()
    twin = _file(tmp_path / "other" / "small.tokens", 10, 3)
    with pytest.raises(ValueError, match=r"named \['small'\] more than once"):
        TokenBlend([(files["small"], 1), (twin, 1)])
    blend = TokenBlend({"small": (files["small"], 1), "twin": (twin, 1)})  # named apart, it is fine
    assert blend.shares == {"small": 0.5, "twin": 0.5}


def test_a_position_of_another_blend_is_refused_naming_the_difference(files, tmp_path):
    loader = TokenLoader(_blend(files, small=0.7, big=0.3), SEQ, 16, seed=1, return_ids=True)
    _steps([loader], 3)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"small: weight 0.7 saved, 0.6 now; big: weight 0.3 saved, 0.4 now"):
        TokenLoader(_blend(files, small=0.6, big=0.4), SEQ, 16).load_state_dict(state)
    with pytest.raises(ValueError, match=r"sources \['small', 'big'\] saved, \['small', 'mid'\] now"):
        TokenLoader(_blend(files, small=0.7, mid=0.3), SEQ, 16).load_state_dict(state)
    changed = _file(tmp_path / "changed.tokens", 100, 9)
    other = {"small": (files["small"], 0.7), "big": (changed, 0.3)}
    with pytest.raises(ValueError, match=r"big: other data \(different .*checksum"):
        TokenLoader(other, SEQ, 16).load_state_dict(state)
    allowed = TokenLoader(other, SEQ, 16, allow_different_data=True)
    allowed.load_state_dict(state)
    assert allowed.source_counts() == loader.source_counts()
    with pytest.raises(ValueError, match="global_batch_size=16, this run's is 32"):
        TokenLoader(_blend(files, small=0.7, big=0.3), SEQ, 32).load_state_dict(state)
    with pytest.raises(ValueError, match="of a blend of"):
        TokenLoader(files["big"], SEQ, 16).load_state_dict(state)
    with pytest.raises(ValueError, match="of a single token file"):
        loader.load_state_dict(TokenLoader(files["big"], SEQ, 16).state_dict())
    with pytest.raises(ValueError, match="counts a blend's sources"):
        TokenLoader(files["big"], SEQ, 16).source_counts()
