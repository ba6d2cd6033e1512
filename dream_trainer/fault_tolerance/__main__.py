"""``python -m dream_trainer.fault_tolerance lighthouse [...]`` (see `main`)."""

from dream_trainer.fault_tolerance.lighthouse import main

raise SystemExit(main())
