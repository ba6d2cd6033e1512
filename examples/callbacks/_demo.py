"""Runs the GPT demo (examples/gpt) with extra callbacks: what every example here uses."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))

from train import main as demo  # noqa: E402

SHORT = ["--steps", "30", "--val-every", "15", "--val-batches", "2", "--n-chars", "60000", "--log-every", "5",
         "--checkpoint-every", "None", "--resume", "None"]


def run(callbacks: list[Any], argv: list[str] | None = None) -> Any:
    """Train the demo (shortened) with `callbacks`; returns the trainer."""
    return demo([*SHORT, *(argv if argv is not None else sys.argv[1:])], callbacks=callbacks)
