"""Fault tolerance (torchft), in one place: train through the loss of whole replica groups.

- `FaultToleranceCallback` makes a job one replica group of a fault-tolerant run (it
  installs a `FaultTolerantWorld`); `FaultToleranceParameters` configures it.
- `FaultTolerantWorld` (``world``): the quorum, gradients averaged over the live groups,
  commits, heals (``transport``: how a heal travels; ``gradients``: the gradient buckets).
- `FaultTolerantSampler` (``sampler``): training data that follows the quorum.
- `Lighthouse` (``lighthouse``): the coordinator, in this process or on the command line::

      python -m dream_trainer.fault_tolerance lighthouse --bind 127.0.0.1:29510

- ``history``: what a run's files say about its groups (`group_roots`, `run_history`,
  `check_progress`, `confined`).

See ``docs/fault_tolerance.md``. torchft is imported only when a fault-tolerant world or a
lighthouse is made.
"""

from dream_trainer.configs import FaultToleranceParameters
from dream_trainer.fault_tolerance.callback import FaultToleranceCallback
from dream_trainer.fault_tolerance.history import check_progress, confined, group_roots, run_history
from dream_trainer.fault_tolerance.lighthouse import Lighthouse, main
from dream_trainer.fault_tolerance.sampler import FaultTolerantSampler, step_units
from dream_trainer.fault_tolerance.world import FaultToleranceError, FaultTolerantWorld

__all__ = ["FaultToleranceCallback", "FaultToleranceError", "FaultToleranceParameters", "FaultTolerantSampler",
           "FaultTolerantWorld", "Lighthouse", "check_progress", "confined", "group_roots", "main", "run_history",
           "step_units"]
