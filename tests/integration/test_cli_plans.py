"""The GPT demo's command line (issue 40): ``summarize --world-size`` plans any mesh in one
process, pp included; ``resume`` of a finished run says so; a missing optional package is
one line and status 2."""

from __future__ import annotations

import sys

import pytest

from tests.demos import SMALL, load


@pytest.mark.parametrize(("argv", "plan", "split"), [
    (["--parallel", "fsdp", "--world-size", "8"], {"world_size": 8, "pp": 1, "dp_replicate": 1, "dp_shard": 8}, 8),
    (["--parallel", "pp", "--world-size", "4"], {"world_size": 4, "pp": 2, "dp_replicate": 1, "dp_shard": 2}, 4),
    (["--parallel", "hsdp", "--world-size", "8", "--local-world-size", "4"],
     {"world_size": 8, "pp": 1, "dp_replicate": 4, "dp_shard": 2}, 2),
])
def test_summarize_plans_another_world_without_launching(tmp_path, capsys, argv, plan, split):
    demo = load("gpt")
    result = demo.main(["summarize", *SMALL, "--root-dir", str(tmp_path), *argv])
    out = capsys.readouterr().out
    assert {k: result["plan"][k] for k in plan} == plan
    assert "plan: " + ", ".join(f"{k}={v}" for k, v in plan.items()) in out
    each = result["per_rank"][0]
    assert result["estimated"] and each["params"] == -(-result["parameters"] // split)
    assert f"estimate for each of {plan['world_size']} ranks" in out


def test_summarize_of_a_plan_that_does_not_fit_is_a_usage_error(tmp_path, capsys):
    demo = load("gpt")
    with pytest.raises(SystemExit) as info:
        demo.main(["summarize", *SMALL, "--root-dir", str(tmp_path), "--parallel", "tp", "--world-size", "3"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "world of 3 rank(s)" in err and "A plan that fits" in err
    assert not (tmp_path / "gpt").exists()  # refused before any trainer was built


def test_resume_of_a_finished_run_says_how_to_extend_it(tmp_path, capsys):
    demo = load("gpt")
    common = [*SMALL, "--root-dir", str(tmp_path), "--val-batches", "1", "--async-checkpoint", "off"]
    demo.main([*common, "--run-name", "done", "--steps", "2"])
    capsys.readouterr()
    trainer = demo.main(["resume", "done", "--root-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert trainer.global_step == 2
    assert "run done is finished: it stopped at step 2, its max_steps (2)" in out
    assert "resume done --steps 4" in out


def test_a_missing_optional_package_is_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    demo = load("gpt")
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, as far as imports go
    with pytest.raises(SystemExit) as info:
        demo.main(["summarize", *SMALL, "--root-dir", str(tmp_path), "--trackers", "wandb"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "wandb" in err and "pip install" in err
    assert "Traceback" not in err
