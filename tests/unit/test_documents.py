"""Document-aware samples (`dream_trainer.data.documents`): no loss on padding or across a
document boundary, position ids that restart at every boundary, and a block-causal mask in
the examples' models, so that a packed window trains like its documents run one by one."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import DataLoader

from dream_trainer.data import TokenDataset, TokenFile, TokenLoader, write_tokens
from dream_trainer.data.documents import DocumentBatch, block_causal_mask, flex_block_mask

ROOT = Path(__file__).resolve().parents[2]
SEQ, VOCAB = 16, 50


def _example(name: str, path: str):
    """An example's model module, loaded from its file under a name of its own."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


gpt = _example("dream_trainer_examples_gpt_model", "examples/gpt/model.py")
llama = _example("dream_trainer_examples_llama_model", "examples/llama/modeling_llama.py")


def _gpt(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, d_model=32, **kw))
    model.init_weights()
    return model.eval()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = llama.LlamaForCausalLM(llama.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                     max_position_embeddings=SEQ))
    model.init_weights()
    return model.eval()


@pytest.fixture()
def corpus(tmp_path):
    """Documents of 0 to 20 tokens (an empty one, one of a single token), in 0..VOCAB-1."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, VOCAB, size=int(rng.integers(2, 21))) for _ in range(60)]
    docs[3], docs[7] = np.array([], dtype=np.int64), np.array([5])
    return write_tokens(tmp_path / "docs.tokens", docs)


def _reference(tf: TokenFile, index: int) -> tuple[list[int], list[int]]:
    """Window `index`'s documents and positions, token by token (the definition)."""
    offsets = [int(o) for o in tf.offsets]
    docs, positions = [], []
    for g in range(index * SEQ, index * SEQ + SEQ + 1):
        d = max(j for j in range(tf.n_docs) if offsets[j] <= g < offsets[j + 1])
        docs.append(d)
        positions.append(g - max(offsets[d], index * SEQ))
    return docs, positions


def _epoch(path, **kw) -> DocumentBatch:
    """Every window of the file, in order, as one DocumentBatch."""
    n = TokenFile(path).n_samples(SEQ)
    return next(iter(TokenLoader(path, SEQ, n, shuffle=False, document_info=True, return_ids=True, **kw)))


# ---------------------------------------------------------------------- the samples
def test_position_ids_restart_at_every_document_and_at_the_window_start(corpus):
    tf, batch = TokenFile(corpus), _epoch(corpus)
    plain_x, plain_y = next(iter(TokenLoader(corpus, SEQ, len(batch.inputs), shuffle=False)))
    assert torch.equal(batch.inputs, plain_x) and torch.equal(batch.targets, plain_y)  # no mask asked for
    mid_document = 0
    for row, i in enumerate(batch.sample_ids.tolist()):
        docs, positions = _reference(tf, i)
        assert batch.position_ids[row].tolist() == positions[:-1]
        assert batch.document_ids[row].tolist() == docs[:-1]
        mid_document += int(tf.offsets[docs[0]]) < i * SEQ  # the window starts inside a document: 0 there too
    assert mid_document > 10 and 3 not in batch.document_ids  # the empty document holds no token
    for t in (batch.inputs, batch.targets, batch.position_ids, batch.document_ids):
        assert t.dtype == torch.int64 and t.shape == (len(batch.inputs), SEQ) and t.is_contiguous()


def test_the_boundary_mask_skips_exactly_the_targets_of_the_next_document(corpus):
    tf, plain, masked = TokenFile(corpus), _epoch(corpus), _epoch(corpus, mask_document_boundaries=True)
    assert torch.equal(masked.inputs, plain.inputs) and torch.equal(masked.position_ids, plain.position_ids)
    for row, i in enumerate(masked.sample_ids.tolist()):
        docs, _ = _reference(tf, i)
        crosses = [docs[t + 1] != docs[t] for t in range(SEQ)]
        expected = [-100 if c else y for c, y in zip(crosses, plain.targets[row].tolist())]
        assert masked.targets[row].tolist() == expected
    assert int((masked.targets == -100).sum()) > 20


def test_documents_mode_pads_inputs_with_pad_id_and_masks_the_targets(corpus):
    tf = TokenFile(corpus)
    batch = next(iter(TokenLoader(corpus, SEQ, tf.n_docs, mode="documents", shuffle=False, pad_id=3,
                                  document_info=True, return_ids=True)))
    for row, i in enumerate(batch.sample_ids.tolist()):
        doc = tf.tokens[int(tf.offsets[i]):int(tf.offsets[i + 1])].astype(np.int64)[:SEQ + 1]
        n = len(doc)
        padded = np.concatenate([doc, np.full(SEQ + 1 - n, 3)])
        assert batch.inputs[row].tolist() == padded[:-1].tolist()
        assert batch.targets[row].tolist() == [*doc[1:].tolist(), *[-100] * (SEQ + 1 - n)][:SEQ]
        assert batch.position_ids[row].tolist() == list(range(SEQ))
        assert batch.document_ids[row].tolist() == [i] * min(n, SEQ) + [-1] * (SEQ - min(n, SEQ))
    assert bool((batch.targets[3] == -100).all()) and bool((batch.targets[7] == -100).all())  # 0 and 1 token


@pytest.mark.parametrize("bad", [-100, -1, 1.5, True])
def test_a_pad_id_that_is_not_a_token_id_is_refused(corpus, bad):
    with pytest.raises(ValueError, match=rf"TokenLoader\(pad_id={bad!r}\): .* a token id \(an int >= 0"):
        TokenLoader(corpus, SEQ, 4, mode="documents", pad_id=bad)
    with pytest.raises(ValueError, match=rf"TokenDataset\(pad_id={bad!r}\)"):
        TokenDataset(corpus, SEQ, mode="documents", pad_id=bad)
    with pytest.raises(ValueError, match=r"TokenLoader\(ignore_index=0\): must be a negative int"):
        TokenLoader(corpus, SEQ, 4, ignore_index=0)


def test_the_dataset_gives_the_loaders_document_batches(corpus):
    data = TokenDataset(corpus, SEQ, document_info=True, mask_document_boundaries=True)
    sample = data[5]
    assert isinstance(sample, DocumentBatch) and sample.inputs.shape == (SEQ,) and int(sample.sample_ids) == 5
    collated = next(iter(DataLoader(data, batch_size=8)))  # torch's default collate keeps the named tuple
    whole = _epoch(corpus, mask_document_boundaries=True)
    assert isinstance(collated, DocumentBatch) and collated.sample_ids.tolist() == list(range(8))
    for ours, theirs in zip(collated[:4], whole[:4]):
        assert torch.equal(ours, theirs[:8])
    assert data[0].__class__ is DocumentBatch and TokenDataset(corpus, SEQ)[0].__class__ is tuple  # the default


def test_a_document_batch_crosses_the_batch_transfer_as_itself(corpus):
    batch = next(iter(TokenLoader(corpus, SEQ, 4, document_info=True)))  # sample_ids None
    leaves, spec = tree_flatten(batch)  # what BatchTransfer moves: every tensor, the structure kept
    assert sum(isinstance(leaf, torch.Tensor) for leaf in leaves) == 4
    again = tree_unflatten(leaves, spec)
    assert isinstance(again, DocumentBatch) and again.sample_ids is None


# ---------------------------------------------------------------------- the models
def _logits(model, inputs, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs, **kw)


def test_no_loss_on_padding_a_documents_batch_is_the_mean_over_real_tokens(corpus):
    """The loss of a padded documents batch equals each document run alone (no padding),
    summed over its real targets and divided by their count."""
    tf, model = TokenFile(corpus), _gpt()
    batch = next(iter(TokenLoader(corpus, SEQ, 12, mode="documents", shuffle=False, pad_id=0, return_ids=True)))
    x, y, ids = batch
    loss = gpt.lm_loss(_logits(model, x), y)
    total, count = 0.0, 0
    for i in ids.tolist():
        doc = torch.from_numpy(tf.tokens[int(tf.offsets[i]):int(tf.offsets[i + 1])].astype(np.int64))[:SEQ + 1]
        if len(doc) < 2:
            continue
        logits = _logits(model, doc[None, :-1])[0]
        total += F.cross_entropy(logits, doc[1:], reduction="sum").item()
        count += len(doc) - 1
    assert count == int((y != -100).sum()) and count < y.numel()
    assert loss.item() == pytest.approx(total / count, rel=1e-5)
    padded_targets = torch.where(y == -100, 0, y)  # what the old default trained on: the padding
    assert gpt.lm_loss(_logits(model, x), padded_targets).item() != pytest.approx(loss.item(), rel=1e-3)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_attention_does_not_cross_a_document_boundary(attention):
    model = _gpt(attention=attention)
    torch.manual_seed(1)
    x = torch.randint(0, VOCAB, (2, SEQ))
    docs = torch.tensor([[0] * 6 + [1] * 10, [4] * 11 + [5] * 5])  # document A, then B
    changed = x.clone()
    changed[0, :6], changed[1, :11] = (changed[0, :6] + 1) % VOCAB, (changed[1, :11] + 7) % VOCAB  # A only
    b_positions = docs == docs[:, -1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex attention in eager: unfused (and says so)
        masked = [_logits(model, t, document_ids=docs)[b_positions] for t in (x, changed)]
    torch.testing.assert_close(masked[0], masked[1], rtol=0, atol=1e-6)
    causal = [_logits(model, t)[b_positions] for t in (x, changed)]
    assert (causal[0] - causal[1]).abs().max() > 1e-3  # without the mask B sees A


def test_flex_and_sdpa_masks_agree():
    docs = torch.tensor([[0] * 5 + [1] * 3 + [2] * 8, [7] * 16])
    dense = block_causal_mask(docs)
    assert dense.shape == (2, 1, SEQ, SEQ) and dense.dtype == torch.bool
    assert bool(dense[0, 0, 7, 5]) and not bool(dense[0, 0, 7, 4]) and not bool(dense[0, 0, 5, 6])
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 2, SEQ, 8) for _ in range(3))
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = flex_attention(q, k, v, block_mask=flex_block_mask(docs))
    torch.testing.assert_close(flex, F.scaled_dot_product_attention(q, k, v, attn_mask=dense), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"block_causal_mask: document_ids of shape \(16,\); expected \(B, T\)"):
        block_causal_mask(docs[0])


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_a_packed_window_trains_like_its_documents_one_by_one(corpus, make):
    """Boundary mask + position reset + block-causal attention: every token's loss in a
    packed window equals its loss with its document (its part in the window) run alone."""
    model, batch = make(), _epoch(corpus, mask_document_boundaries=True)
    x, y, pos, docs = batch.inputs[:24], batch.targets[:24], batch.position_ids[:24], batch.document_ids[:24]
    packed = F.cross_entropy(_logits(model, x, position_ids=pos, document_ids=docs).transpose(1, 2), y,
                             reduction="none")
    alone = torch.zeros_like(packed)
    for row in range(len(x)):
        for d in docs[row].unique().tolist():
            part = (docs[row] == d).nonzero().flatten()
            logits = _logits(model, x[row, part][None])[0]
            alone[row, part] = F.cross_entropy(logits, y[row, part], reduction="none")  # -100: 0, as packed
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    mean = gpt.lm_loss(_logits(model, x, position_ids=pos, document_ids=docs), y)
    assert mean.item() == pytest.approx((alone.sum() / (y != -100).sum()).item(), rel=1e-5)
    plain = F.cross_entropy(_logits(model, x).transpose(1, 2), y, reduction="none")
    assert (plain - alone).abs().max() > 1e-2  # without positions and mask the window is another thing


def test_the_models_default_path_is_unchanged():
    """No document information: the plain causal model (positions arange, is_causal)."""
    model = _gpt()
    torch.manual_seed(3)
    x = torch.randint(0, VOCAB, (2, SEQ))
    one_document = torch.zeros_like(x)
    plain = _logits(model, x)
    assert torch.equal(plain, _logits(model, x, position_ids=torch.arange(SEQ).expand(2, SEQ)))
    torch.testing.assert_close(plain, _logits(model, x, document_ids=one_document), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"GPTConfig\(attention='ring'\): use one of \('sdpa', 'flex'\)"):
        gpt.GPTConfig(vocab_size=VOCAB, attention="ring")
