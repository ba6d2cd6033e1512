"""The acceptance matrix: the GPT demo and the Llama example, run through their own
``main`` the way a user runs them, across layout x eager/compiled x float32/float8 x health
on/off. Every row trains 8 steps with validation and an (async) checkpoint every 4 steps —
the checkpoint at step 4 is taken right after a validation — then resumes from that
checkpoint in a new trainer and trains to step 8 again. Each row must

(a) start from the single-process initialization (every parameter's ``full_tensor()``
    bitwise equal to one process's with the same seed),
(b) track the single-process eager loss curve of its model and precision within the row's
    tolerance: float32 within `TOLERANCE` relative (reduction order across ranks; inductor's
    fusions); float8 within twice float8's own deviation from float32 at that step plus 2 %
    (`float8_bound`: each data-parallel rank scales its activations and gradients by the amax
    of its own micro-batch, so float8 rounding differs from one process's and the curves
    drift apart through the updates by about as much as float8 differs from float32),
(c) resume bit-exactly: the resumed run's losses at steps 5-8 and final weights equal the
    uninterrupted run's.

Covering subset (pairwise): 12 rows cover every pair of factor values. Each layout appears
twice, with complementary settings of the four two-valued factors (model, compile, float8,
health), and the four complementary pairs chosen cover every pair of those factors
(``ROWS``). HSDP runs on 4 ranks, the other sharded layouts on 2. Pipeline parallelism
cannot run the Llama example (its embedding and head are tied): its compiled, float8,
health-on row is the extra `PIPELINE_ROW`.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dream_trainer.testing import spawn_world
from tests.demos import SMALL, Record, load

pytest.importorskip("torchao")

STEPS, EVERY = 8, 4
ARGS = [*SMALL, "--steps", str(STEPS), "--val-every", str(EVERY), "--checkpoint-every", str(EVERY),
        "--val-batches", "2", "--batch-size", "16"]
RANKS = {"single": 1, "ddp": 2, "fsdp": 2, "tp": 2, "hsdp": 4, "cp": 2, "pp": 2}

# (model, compiled, float8, health) per complementary pair; see the module docstring.
_PAIRS = {
    "single": ("gpt", False, False, False),
    "ddp": ("gpt", False, True, True),
    "hsdp": ("gpt", True, False, True),
    "fsdp": ("gpt", True, True, False),
    "tp": ("gpt", False, True, True),
    "cp": ("gpt", True, True, True),  # context parallel: sequences split over the 2 ranks (FSDP2 over them)
}


def _complement(row):
    model, compiled, fp8, health = row
    return ("llama" if model == "gpt" else "gpt", not compiled, not fp8, not health)


ROWS = [(layout, *row) for layout, first in _PAIRS.items() for row in (first, _complement(first))]
# Pipeline parallel (2 stages), GPT only (the Llama example ties its embedding and head).
PIPELINE_ROW = ("pp", "gpt", True, True, True)

# Relative tolerance on each step's float32 loss against the single-process eager run.
TOLERANCE = {"eager": 1e-4, "compiled": 1e-3}


def float8_bound(fp8: torch.Tensor, fp32: torch.Tensor) -> torch.Tensor:
    """Per step: how far a float8 curve may be from single-process float8 (see (b))."""
    return 2 * (fp8 - fp32).abs() + 0.02 * fp8.abs()


def _row_id(row):
    layout, model, compiled, fp8, health = row
    return f"{layout}-{model}-{'compiled' if compiled else 'eager'}-{'fp8' if fp8 else 'fp32'}-{'health' if health else 'plain'}"


def _callbacks(fp8, health):
    from dream_trainer.callbacks import Fp8QuantizationCallback, health_callbacks

    out = [Fp8QuantizationCallback()] if fp8 else []
    if health:
        out += health_callbacks(dashboard=False)
    return out


def _train(model, layout, compiled, fp8, health, root, run_name, resume="None"):
    record = Record()
    args = [*ARGS, "--parallel", layout, "--root-dir", root, "--run-name", run_name, "--resume", resume]
    trainer = load(model).main([*args, *(["--compile"] if compiled else [])], callbacks=[record, *_callbacks(fp8, health)])
    assert trainer.status == "completed", trainer.status
    return record.result()


def _row(row, root):
    layout, model, compiled, fp8, health = row
    if dist.is_available() and not dist.is_initialized() and RANKS[layout] > 1:
        dist.init_process_group("gloo")  # both runs of the row share it
    full = _train(model, layout, compiled, fp8, health, root, "full")
    checkpoint = Path(root) / model / "full" / "checkpoints" / f"step_{EVERY:09d}"
    resumed = _train(model, layout, compiled, fp8, health, root, "resumed", resume=str(checkpoint))
    return {"full": full, "resumed": resumed}


def _curve(run):
    return torch.tensor([run["losses"][s] for s in range(1, STEPS + 1)])


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process eager run of each model and precision."""
    root = str(tmp_path_factory.mktemp("reference"))
    return {(model, fp8): _train(model, "single", False, fp8, False, root, f"ref-{model}-{fp8}")
            for model, fp8 in itertools.product(("gpt", "llama"), (False, True))}


def test_rows_cover_every_pair():
    factors = [sorted(_PAIRS), ["gpt", "llama"], [False, True], [False, True], [False, True]]
    for i, j in itertools.combinations(range(len(factors)), 2):
        seen = {(row[i], row[j]) for row in ROWS}
        assert seen == set(itertools.product(factors[i], factors[j])), (i, j)


@pytest.mark.parametrize("row", [*ROWS, PIPELINE_ROW], ids=_row_id)
def test_row(row, references, tmp_path):
    layout, model, compiled, fp8, health = row
    if RANKS[layout] == 1:
        result = _row(row, str(tmp_path))
    else:
        ranks = spawn_world(RANKS[layout], _row, row, str(tmp_path), timeout=600)
        result = ranks[0]
        for other in ranks[1:]:  # every rank saw the same global losses
            assert other["full"]["losses"] == result["full"]["losses"]
        if layout == "pp":  # each stage holds its layers: the model is all of them
            for run, weights in itertools.product(("full", "resumed"), ("initial", "final")):
                result[run][weights] = {name: t for rank in ranks for name, t in rank[run][weights].items()}
    reference = references[(model, fp8)]
    full, resumed = result["full"], result["resumed"]
    # (a) the single-process initialization, bitwise
    assert set(full["initial"]) == set(reference["initial"])
    for name, value in reference["initial"].items():
        assert torch.equal(full["initial"][name], value), f"initial {name}"
    # (b) the single-process loss curve
    assert sorted(full["losses"]) == list(range(1, STEPS + 1))
    got, want = _curve(full), _curve(reference)
    if fp8:
        bound = float8_bound(want, _curve(references[(model, False)]))
        assert torch.all((got - want).abs() <= bound), f"float8 loss curve {got} vs single process {want}, bound {bound}"
    else:
        tolerance = TOLERANCE["compiled" if compiled else "eager"]
        torch.testing.assert_close(got, want, rtol=tolerance, atol=0.0, msg=lambda m: f"loss curve vs single process: {m}")
    # (c) the resume from the checkpoint taken on a validation step, bit-exact
    assert sorted(resumed["losses"]) == list(range(EVERY + 1, STEPS + 1))
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], f"step {step}: resumed {loss} != {full['losses'][step]}"
    for name, value in full["final"].items():
        assert torch.equal(resumed["final"][name], value), f"final {name}"
