"""Data that follows the world: token files, a global sample order over them, and a loader
whose position belongs to the run (see ``docs/data.md``)."""

from dream_trainer.data.loader import TokenDataset, TokenLoader
from dream_trainer.data.tokens import GlobalOrder, TokenFile, TokenFileError, split_global_batch, write_tokens

__all__ = ["GlobalOrder", "TokenDataset", "TokenFile", "TokenFileError", "TokenLoader", "split_global_batch",
           "write_tokens"]
