"""The cuda lane for document-aware samples: a `DocumentBatch` pinned by the `TokenLoader`
(every tensor pinned and contiguous) crosses the batch transfer without pageable copies, and
the GPT demo's block-causal attention (SDPA's boolean mask; flex attention compiled) on the
GPU gives the packed window the losses of its documents run one by one (SDPA's: with no
host sync)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cuda_lane import on_cuda

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]


def _packed_on_cuda(tmp: str) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from dream_trainer.data import TokenLoader, write_tokens
    from dream_trainer.world.transfer import BatchTransfer

    spec = importlib.util.spec_from_file_location("gpt_model_cuda_lane", ROOT / "examples" / "gpt" / "model.py")
    gpt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpt
    spec.loader.exec_module(gpt)

    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 50, size=int(rng.integers(2, 40))) for _ in range(80)]
    path = write_tokens(Path(tmp) / "docs.tokens", documents)
    loader = TokenLoader(path, 64, 8, pin_memory=True, document_info=True, mask_document_boundaries=True)
    batch = next(iter(loader))
    pinned = all(t.is_pinned() and t.is_contiguous() for t in batch[:4])
    transfer = BatchTransfer()
    transfer.start(torch.device("cuda", 0))
    moved = transfer(batch)
    out: dict[str, Any] = {"pinned": pinned, "pageable": transfer.pageable_bytes, "type": type(moved).__name__}
    for attention in ("sdpa", "flex"):
        torch.manual_seed(0)
        model = gpt.GPT(gpt.GPTConfig(vocab_size=50, block_size=64, n_layer=2, n_head=2, d_model=64,
                                      attention=attention)).cuda()
        model.init_weights()
        model.eval()
        run = torch.compile(model) if attention == "flex" else model  # flex attention is fused when compiled
        with torch.no_grad():
            run(moved.inputs, moved.position_ids, moved.document_ids)  # compile / warm up
            torch.cuda.synchronize()
            if attention == "sdpa":  # the boolean mask: a hidden host-device sync in the forward would raise
                torch.cuda.set_sync_debug_mode("error")
            try:
                logits = run(moved.inputs, moved.position_ids, moved.document_ids)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            packed = F.cross_entropy(logits.float().transpose(1, 2), moved.targets, reduction="none")
            alone = torch.zeros_like(packed)
            for row in range(len(moved.inputs)):
                for d in moved.document_ids[row].unique().tolist():
                    part = (moved.document_ids[row] == d).nonzero().flatten()
                    alone[row, part] = F.cross_entropy(model(moved.inputs[row, part][None])[0].float(),
                                                       moved.targets[row, part], reduction="none")
        out[attention] = float((packed - alone).abs().max())
    return out


def test_a_pinned_document_batch_trains_like_its_documents_on_cuda(tmp_path):
    (out,) = on_cuda(_packed_on_cuda, str(tmp_path))
    assert out["pinned"] and out["pageable"] == 0 and out["type"] == "DocumentBatch"
    assert out["sdpa"] < 1e-4 and out["flex"] < 1e-4, out
