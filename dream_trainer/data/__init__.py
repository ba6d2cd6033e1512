"""Data that follows the world: token files, a global sample order over them, and a loader
whose position belongs to the run (see ``docs/data.md``)."""

from dream_trainer.data.blend import BlendOrder, TokenBlend, apportion
from dream_trainer.data.documents import DocumentBatch, block_causal_mask, flex_block_mask
from dream_trainer.data.loader import TokenDataset, TokenLoader
from dream_trainer.data.tokens import (GlobalOrder, TokenFile, TokenFileError, TokenWriter, split_global_batch,
                                      write_tokens)

__all__ = ["BlendOrder", "DocumentBatch", "GlobalOrder", "TokenBlend", "TokenDataset", "TokenFile", "TokenFileError",
           "TokenLoader", "TokenWriter", "apportion", "block_causal_mask", "flex_block_mask", "split_global_batch",
           "write_tokens"]
