"""`entrypoint`: run a training `main()` in a plain process, under torchrun, or spawn N
local ranks with ``torch.distributed.run``.

The run's identity (experiment name, run name/directory, seed) is put in the environment
before the ranks start, so every rank agrees on it::

    from dream_trainer import entrypoint

    def main():
        DemoTrainer(config).fit()

    if __name__ == "__main__":
        entrypoint(main)          # python train.py --nproc 2   or   torchrun ... train.py
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

ENV_NPROC = "DREAM_TRAINER_NPROC"
ENV_EXPERIMENT = "DREAM_TRAINER_EXPERIMENT"
ENV_RUN_NAME = "DREAM_TRAINER_RUN_NAME"
ENV_RUN_DIR = "DREAM_TRAINER_RUN_DIR"
ENV_SEED = "DREAM_TRAINER_SEED"


@dataclass(frozen=True)
class RunIdentity:
    """What every rank of a run must agree on; read from the environment."""

    experiment: str | None
    run_name: str | None
    run_dir: str | None
    seed: int | None

    @classmethod
    def from_env(cls) -> RunIdentity:
        seed = os.environ.get(ENV_SEED)
        return cls(
            experiment=os.environ.get(ENV_EXPERIMENT) or None,
            run_name=os.environ.get(ENV_RUN_NAME) or None,
            run_dir=os.environ.get(ENV_RUN_DIR) or None,
            seed=int(seed) if seed else None,
        )


def is_launched() -> bool:
    """True inside a rank started by torchrun (or by `entrypoint`)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _pop_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    rest, nproc, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--nproc":
            if i + 1 >= len(argv):
                raise ValueError("--nproc needs a value (the number of local ranks)")
            nproc, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--nproc="):
            nproc, i = arg.split("=", 1)[1], i + 1
            continue
        rest.append(arg)
        i += 1
    if nproc is None:
        return None, rest
    try:
        value = int(nproc)
    except ValueError:
        raise ValueError(f"--nproc={nproc!r} is invalid: expected a positive integer") from None
    if value < 1:
        raise ValueError(f"--nproc={value} is invalid: expected a positive integer")
    return value, rest


def entrypoint(
    main: Callable[[], T],
    *,
    nproc: int | None = None,
    experiment: str | None = None,
    seed: int | None = None,
    argv: list[str] | None = None,
) -> T | None:
    """Run `main` once per rank.

    - Under torchrun (or in a rank this function spawned): call ``main()``.
    - With ``--nproc N`` on the command line, the ``DREAM_TRAINER_NPROC`` variable or
      `nproc` (in that order of precedence), N > 1: spawn N local ranks of this same script
      through ``torch.distributed.run`` on 127.0.0.1 and a free port; returns None.
    - Otherwise: call ``main()`` in this process and return its result.

    ``--nproc`` is removed from ``sys.argv`` before ``main`` parses it. A run name (a
    timestamp), and `experiment`/`seed` when given, are exported so every rank agrees.
    """
    if is_launched():
        return main()
    args = list(sys.argv[1:] if argv is None else argv)
    cli_nproc, rest = _pop_nproc(args)
    env_nproc = os.environ.get(ENV_NPROC)
    if cli_nproc is not None:
        nproc = cli_nproc
    elif env_nproc:
        nproc, _ = _pop_nproc(["--nproc", env_nproc])
    if argv is None:
        sys.argv[1:] = rest
    os.environ.setdefault(ENV_RUN_NAME, time.strftime("%Y%m%d-%H%M%S"))
    if experiment is not None:
        os.environ.setdefault(ENV_EXPERIMENT, experiment)
    if seed is not None:
        os.environ.setdefault(ENV_SEED, str(seed))
    if nproc is None or nproc == 1:
        return main()
    _spawn(nproc, rest)
    return None


def _spawn(nproc: int, script_args: list[str]) -> None:
    from torch.distributed.run import get_args_parser, run

    launcher = [
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--max_restarts=0",
    ]
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        target = ["--module", spec.name.removesuffix(".__main__")]
    else:
        target = [os.path.abspath(sys.argv[0])]
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks talk over loopback
    run(get_args_parser().parse_args(launcher + target + script_args))
