"""Lazy package exports (PEP 562): a package names what it exports and from where, and each
name is imported on first use. ``import dream_trainer`` then costs nothing until a name is
used, so a tool that needs no torch (``python -m dream_trainer.data.prepare``) does not load
it (about 280 MB of resident memory)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for `package`: `exports` maps a module (relative to
    `package`, e.g. ``".trainer"``) to the names it exports; a name is imported from its
    module on first access and kept in `namespace` (the package's globals). Any other
    attribute is tried as a submodule (``dream_trainer.callbacks``), as an eager import
    would have made it available."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
        else:
            try:
                value = importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise  # the submodule exists but an import inside it failed
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
