"""Train a small Hugging Face–style Llama (RoPE, RMSNorm, grouped-query attention, SwiGLU,
tied embeddings; random init, no download) on the GPT demo's generated corpus, with the
demo's loop and options::

    python examples/llama/train.py                                    # one process
    python examples/llama/train.py --nproc 2 --parallel fsdp          # or ddp, tp; hsdp on 4 ranks
    torchrun --nproc_per_node 2 examples/llama/train.py --parallel tp --compile

Every option of ``examples/gpt/train.py`` applies (``--help``); ``--d-model``, ``--n-layer``
and ``--n-head`` set ``hidden_size``, ``num_hidden_layers`` and ``num_attention_heads``
(``num_key_value_heads`` is half the heads: grouped-query attention).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from modeling_llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

from dream_trainer import entrypoint  # noqa: E402


def _load_gpt_demo() -> Any:
    """examples/gpt/train.py, under a name of its own (both examples have a train.py)."""
    name = "dream_trainer_examples_gpt_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "gpt" / "train.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules[name]


_gpt = _load_gpt_demo()
GPTTrainer = _gpt.GPTTrainer


class LlamaTrainer(GPTTrainer):
    """The GPT demo's trainer with a Llama model: its own build and parallelization hooks."""

    def __init__(self, config: Any):
        super().__init__(config)
        shape = config.model
        self.llama_config = LlamaConfig(
            vocab_size=self.tokenizer.vocab_size,
            hidden_size=shape.d_model,
            intermediate_size=_multiple_of(int(8 * shape.d_model / 3), 16),
            num_hidden_layers=shape.n_layer,
            num_attention_heads=shape.n_head,
            num_key_value_heads=max(1, shape.n_head // 2),
            max_position_embeddings=shape.block_size,
        )

    def configure_models(self) -> None:
        self.model = LlamaForCausalLM(self.llama_config)  # on the meta device

    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        """Attention sharded by heads (q/k/v colwise, o rowwise), the MLP by its hidden
        width; the tied embedding and head stay replicated."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        heads, kv_heads = self.llama_config.num_attention_heads, self.llama_config.num_key_value_heads
        if heads % tp_mesh.size() or kv_heads % tp_mesh.size():
            raise ValueError(f"tensor_parallel={tp_mesh.size()} must divide num_attention_heads={heads} and "
                             f"num_key_value_heads={kv_heads}")
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in self.model.model.layers:
            parallelize_module(layer, tp_mesh, plan)

    def apply_compile(self) -> None:
        for layer in self.model.model.layers:
            self.compile_module(layer)

    def apply_fully_shard(self, fsdp_config: dict[str, Any]) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer, **fsdp_config)
        fully_shard(self.model, **fsdp_config)  # the root: the tied embedding/head and the final norm


def _multiple_of(value: int, multiple: int) -> int:
    return multiple * ((value + multiple - 1) // multiple)


def main(argv: list[str] | None = None, callbacks: list[Any] | None = None) -> LlamaTrainer:
    return _gpt.main(argv, callbacks, trainer_cls=LlamaTrainer,  # type: ignore[no-any-return]
                     config=_gpt.GPTRunConfig(experiment="llama"))


if __name__ == "__main__":
    raise SystemExit(getattr(entrypoint(main), "exit_code", 0))
