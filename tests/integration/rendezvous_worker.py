"""One rank of a bare `DistributedWorld` for the rendezvous tests: launch (from the
``RANK``/``WORLD_SIZE``/``MASTER_*`` environment), then all-reduce in a loop.

    python rendezvous_worker.py --init-timeout 3 [--victim 1 (--die-at 20 | --fail-at 20)]

On rank ``--victim`` only: ``--die-at K`` SIGKILLs the process at iteration K (a lost node);
``--fail-at K`` raises ``ValueError("boom")`` there (this rank's own error). A rank whose collective fails prints
the exception with its notes (`DistributedWorld.explain_failure`) and exits 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from dream_trainer.configs import DeviceParameters
from dream_trainer.world.world import DistributedWorld


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--init-timeout", type=float, required=True)
    p.add_argument("--victim", type=int, default=None)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--fail-at", type=int, default=None)
    args = p.parse_args()
    world = DistributedWorld(DeviceParameters(init_timeout_s=args.init_timeout))
    world.launch()
    print(f"rank {world.rank}: launched", flush=True)
    victim = world.rank == args.victim
    try:
        for i in range(100_000):
            dist.all_reduce(torch.ones(4))
            if victim and i == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if victim and i == args.fail_at:
                raise ValueError("boom")
    except Exception as exc:  # noqa: BLE001 - printed with the world's explanation
        world.explain_failure(exc)
        traceback.print_exception(exc)
        world.teardown(abort=True)
        return 1
    world.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
