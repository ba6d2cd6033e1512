"""The README's quick-start trainer, as written there (its unseeded `shuffle=True` loader
included): preempted mid-epoch by SIGTERM and run again, it logs exactly the losses of a
run that was never stopped."""

import os
import re
import signal
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_namespace():
    code = re.search(r"## A trainer\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    return namespace


def _run(namespace, losses, preempt_at=None):
    base = namespace["Regression"]

    class Recorded(base):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            losses.append(out["loss"].item())
            if preempt_at is not None and self.global_step == preempt_at:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would
            return out

    namespace["Regression"] = Recorded
    try:
        return namespace["main"]()
    finally:
        namespace["Regression"] = base


def test_readme_example_resumes_exactly_after_preemption(tmp_path, monkeypatch):
    namespace = _readme_namespace()
    (tmp_path / "full").mkdir()
    (tmp_path / "cut").mkdir()
    monkeypatch.chdir(tmp_path / "full")
    full = []
    assert _run(namespace, full).exit_code == 0 and len(full) == 3 * 1024 // 32

    monkeypatch.chdir(tmp_path / "cut")
    first, second = [], []
    preempted = _run(namespace, first, preempt_at=40)  # step 41, in epoch 1 of 0..2
    assert preempted.status == "preempted" and preempted.exit_code == 75
    resumed = _run(namespace, second)
    assert resumed.resumed and resumed.exit_code == 0
    assert first + second == full  # bit for bit, in the interrupted epoch and the next
