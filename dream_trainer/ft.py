"""The former name of `dream_trainer.fault_tolerance`, kept so that existing imports and
``python -m dream_trainer.ft lighthouse`` go on working; importing it warns once
(`DeprecationWarning`) with the new name."""

import warnings

from dream_trainer.fault_tolerance import (
    FaultTolerantSampler,
    Lighthouse,
    check_progress,
    confined,
    group_roots,
    main,
    run_history,
    step_units,
)

__all__ = ["FaultTolerantSampler", "Lighthouse", "check_progress", "confined", "group_roots", "main", "run_history",
           "step_units"]

warnings.warn("dream_trainer.ft is now dream_trainer.fault_tolerance (python -m dream_trainer.fault_tolerance "
              "lighthouse); the old name will be removed", DeprecationWarning, stacklevel=2)

if __name__ == "__main__":
    raise SystemExit(main())
