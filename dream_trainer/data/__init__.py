"""Data that follows the world: token files and a global sample order (issue 23, first part)."""

from dream_trainer.data.tokens import GlobalOrder, TokenFile, TokenFileError, split_global_batch, write_tokens

__all__ = ["GlobalOrder", "TokenFile", "TokenFileError", "split_global_batch", "write_tokens"]
