"""Context-parallel attention, whatever the model's attention looks like: the load-balancing
decision (one function, the same on CPU and CUDA; CUDA's ring mocked here), attention
imported by name, grouped-query attention (``enable_gqa`` and Llama's repeated heads)
against the whole sequence on 2 gloo ranks, attention that bypasses the ring refused, and
pipeline or tensor parallelism with context parallelism refused before anything is built."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as imported_sdpa  # a model's import by name

from dream_trainer import DeviceParameters, TrainerConfig
from dream_trainer import context_parallel as cp_module
from dream_trainer.context_parallel import ContextParallel, load_balanced, repeat_kv_heads, sequence_positions
from dream_trainer.testing import ToyTrainer, spawn_world


# ---------------------------------------------------------------------------- load balancing, both devices
def test_load_balancing_is_for_causal_attention_only():
    assert load_balanced(True) is True and load_balanced(False) is False


class _FakeMesh:
    def size(self) -> int:
        return 2

    def get_local_rank(self) -> int:
        return 0

    def get_group(self) -> str:
        return "group"


def _mock_rings(monkeypatch) -> list:
    """Both devices' rings replaced by one that records the load-balancing option it runs
    under (this machine has no CUDA, and no group here)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    seen: list = []

    def record(query, *args):
        seen.append(_attention._cp_options.enable_load_balance)
        return query

    monkeypatch.setattr(ContextParallel, "_cuda_ring", lambda self, query, *args: record(query))
    monkeypatch.setattr(cp_module, "_RingAttention", types.SimpleNamespace(apply=record))
    monkeypatch.setattr(_attention, "_enable_cp_dtensor_dispatcher", lambda: seen.append("dispatch on"))
    monkeypatch.setattr(_attention, "_disable_cp_dtensor_dispatcher", lambda: seen.append("dispatch off"))
    return seen


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_both_devices_balance_causal_attention_and_run_full_attention_unbalanced(monkeypatch, device):
    """On CUDA full attention used to be refused ("Load balancing requires is_causal=True"):
    the region forced load balancing there. Now both devices ask `load_balanced`."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    seen = _mock_rings(monkeypatch)
    cp, q = ContextParallel(_FakeMesh()), torch.randn(1, 2, 4, 8)
    before = _attention._cp_options.enable_load_balance
    for causal in (False, True):
        with cp.region(torch.device(device)):
            imported_sdpa(q, q, q, is_causal=causal)
            F.scaled_dot_product_attention(q, q, q, is_causal=causal)
        assert _attention._cp_options.enable_load_balance == before  # restored after the region
    runs = [causal for causal in seen if not isinstance(causal, str)]
    assert runs == [False, False, True, True]
    dispatch = [event for event in seen if isinstance(event, str)]
    assert dispatch == (["dispatch on", "dispatch off"] * 2 if device == "cuda" else [])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_mixing_causal_and_full_attention_in_one_step_is_refused_on_both_devices(monkeypatch, device):
    _mock_rings(monkeypatch)
    cp, q = ContextParallel(_FakeMesh()), torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=r"is_causal=False after is_causal=True in the same step"):
        with cp.region(torch.device(device)):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
            F.scaled_dot_product_attention(q, q, q)


def test_attention_outside_a_region_is_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match=r"inside a context-parallel region"):
        ContextParallel(_FakeMesh()).attention(q, q, q)


def test_grouped_query_heads_are_repeated_to_the_query_heads():
    query, key = torch.randn(1, 4, 3, 2), torch.randn(1, 2, 3, 2)
    k, v = repeat_kv_heads(query, key, key + 1)
    assert k.shape == (1, 4, 3, 2) and torch.equal(k[:, 1], key[:, 0]) and torch.equal(k[:, 2], key[:, 1])
    torch.testing.assert_close(F.scaled_dot_product_attention(query, k, v),
                               F.scaled_dot_product_attention(query, key, key + 1, enable_gqa=True))
    with pytest.raises(ValueError, match=r"4 query heads, 3 key heads and 3 value heads"):
        repeat_kv_heads(query, torch.randn(1, 3, 3, 2), torch.randn(1, 3, 3, 2))


# ---------------------------------------------------------------------------- on 2 ranks
def _attention_cases() -> dict:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallel(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",)), seq_dim=2)
    torch.manual_seed(0)
    x = torch.randn(2, 4, 16, 8)  # (batch, heads, sequence, features): the same on every rank
    weight = torch.randn(8, 24, requires_grad=True)

    def by_name(x):  # a model that did `from torch.nn.functional import scaled_dot_product_attention`
        q, k, v = (x @ weight).split(8, -1)
        return imported_sdpa(q, k, v, is_causal=True)

    def gqa(x):  # 4 query heads, 2 key/value heads, SDPA repeats them
        q, kv = (x @ weight[:, :16]).split(8, -1)
        return F.scaled_dot_product_attention(q, kv[:, ::2], kv[:, 1::2], is_causal=True, enable_gqa=True)

    def llama_gqa(x):  # the Llama example: the model repeats the key/value heads itself, full attention here
        q, kv = (x @ weight[:, :16]).split(8, -1)
        k, v = kv[:, ::2].repeat_interleave(2, dim=1), kv[:, 1::2].repeat_interleave(2, dim=1)
        return imported_sdpa(q, k, v)

    results = {name: _against_whole(cp, fn, x, weight) for name, fn in
               (("by_name", by_name), ("gqa", gqa), ("llama_gqa", llama_gqa))}
    results["refused"] = _refusals(cp, x)
    return results


def _against_whole(cp: ContextParallel, attention, x: torch.Tensor, weight: torch.Tensor) -> dict:
    """`attention` on the whole sequence and ringed over the shards, forward and backward."""
    whole = attention(x)
    (whole ** 2).sum().backward()
    whole_grad, weight.grad = weight.grad.clone(), None
    with cp.region(torch.device("cpu")):
        out = attention(cp.shard(x))
        positions = sequence_positions(out.shape[2])
        (out ** 2).sum().backward()
    grad, weight.grad = weight.grad.clone(), None
    dist.all_reduce(grad)  # each rank's share of the gradient
    return {"out": out.detach(), "expected": whole.detach().index_select(2, positions), "grad": grad,
            "whole_grad": whole_grad, "calls": cp.calls}


def _refusals(cp: ContextParallel, x: torch.Tensor) -> list[str]:
    """Attention that would silently see only this rank's tokens fails instead."""
    def by_hand(part):
        return torch.softmax(part @ part.transpose(-1, -2), -1) @ part

    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    refused = []
    for attention in (by_hand, lambda part: mha(part[:, 0], part[:, 0], part[:, 0], need_weights=False)[0]):
        try:
            with cp.region(torch.device("cpu")):
                attention(cp.shard(x))
        except (RuntimeError, NotImplementedError) as exc:
            refused.append(str(exc))
    return refused


def test_attention_imported_by_name_and_grouped_query_attention_match_the_whole_sequence():
    """Before, the ring replaced ``F.scaled_dot_product_attention`` by attribute: a model that
    imported it by name ran local attention, silently wrong (|out - whole| ~ 31 here)."""
    ranks = spawn_world(2, _attention_cases, timeout=180)
    for rank in ranks:
        for name in ("by_name", "gqa", "llama_gqa"):
            case = rank[name]
            assert case["calls"] == 1, name  # one attention call per step, ringed
            torch.testing.assert_close(case["out"], case["expected"], rtol=1e-5, atol=1e-5, msg=name)
            scale = case["whole_grad"].abs().max()  # gradients of a sum of squares, summed in another order
            assert (case["grad"] - case["whole_grad"]).abs().max() <= 1e-5 * scale, name
        by_hand, mha = rank["refused"]
        assert "no torch.nn.functional.scaled_dot_product_attention call ran" in by_hand
        assert "multi_head_attention_forward in a context-parallel region" in mha


# ---------------------------------------------------------------------------- compositions
@pytest.mark.parametrize("sizes", [{"pipeline_parallel": 2}, {"tensor_parallel": 2}])
def test_pipeline_or_tensor_parallel_with_context_parallel_is_refused_before_building(monkeypatch, sizes):
    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():  # rank 0 of a torchrun world of 4
        monkeypatch.setenv(key, value)
    params = DeviceParameters(dp_replicate=1, dp_shard=1, context_parallel=2, **sizes)
    trainer = ToyTrainer(TrainerConfig(device_parameters=params))
    monkeypatch.setattr(trainer, "_require", lambda *args: None)  # the toy lacks the parallelism hooks
    with pytest.raises(ValueError, match=r"context_parallel=2 with pipeline_parallel=\d, tensor_parallel=\d: context "
                                         r"parallelism composes with FSDP2/HSDP only for now"):
        trainer._check_configuration()
    assert not dist.is_initialized()
