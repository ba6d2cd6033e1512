"""Data that follows the world: token files, a global sample order over them, and a loader
whose position belongs to the run (see ``docs/data.md``). Each name is imported on first use:
``python -m dream_trainer.data.prepare`` needs no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dream_trainer._lazy import lazy_exports

if TYPE_CHECKING:  # what the names are, for type checkers
    from dream_trainer.data.blend import BlendOrder, TokenBlend, apportion
    from dream_trainer.data.documents import DocumentBatch, block_causal_mask, flex_block_mask
    from dream_trainer.data.loader import TokenDataset, TokenLoader
    from dream_trainer.data.tokens import (GlobalOrder, TokenFile, TokenFileError, TokenWriter, split_global_batch,
                                          write_tokens)

_EXPORTS: dict[str, tuple[str, ...]] = {
    ".blend": ("BlendOrder", "TokenBlend", "apportion"),
    ".documents": ("DocumentBatch", "block_causal_mask", "flex_block_mask"),
    ".loader": ("TokenDataset", "TokenLoader"),
    ".tokens": ("GlobalOrder", "TokenFile", "TokenFileError", "TokenWriter", "split_global_batch", "write_tokens"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = ["BlendOrder", "DocumentBatch", "GlobalOrder", "TokenBlend", "TokenDataset", "TokenFile", "TokenFileError",
           "TokenLoader", "TokenWriter", "apportion", "block_causal_mask", "flex_block_mask", "split_global_batch",
           "write_tokens"]
