"""A fault-tolerant run of the GPT demo on one machine: a lighthouse and N replica groups
(torchft). Optionally one group is killed (SIGKILL, every process of it) in the middle of
the run and restarted: the others keep training without it, and the restarted group heals
from a live peer and trains with them again.

    python examples/gpt/fault_tolerant.py                                # 2 groups x 1 process
    python examples/gpt/fault_tolerant.py --kill-group 1 --kill-at 60    # kill group 1 at step 60, restart it
    python examples/gpt/fault_tolerant.py --nproc 2 --parallel fsdp      # 2 groups x 2 ranks (FSDP2 in a group)

Arguments after ``--`` go to every group's ``train.py`` (e.g. ``-- --steps 300``). Each group
writes to ``<root-dir>/gpt/<run-name>/replica_group_<id>/`` (logs, checkpoints and
``fault_tolerance.jsonl``, its quorum/heal events); a summary is printed at the end.

By hand, the same is (one terminal each)::

    python -m dream_trainer.fault_tolerance lighthouse --bind 127.0.0.1:29510
    python examples/gpt/train.py --ft-group 0 --lighthouse http://127.0.0.1:29510 --run-name ft
    python examples/gpt/train.py --ft-group 1 --lighthouse http://127.0.0.1:29510 --run-name ft
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from dream_trainer.fault_tolerance import Lighthouse  # noqa: E402
from dream_trainer.testing.fault_tolerance import ReplicaGroup, wait_until  # noqa: E402


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the demo; returns the summary (also printed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="ranks per group")
    p.add_argument("--parallel", default="ddp", help="the layout inside a group (train.py --parallel)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-group", type=int, default=None, help="SIGKILL this group once it reached --kill-at")
    p.add_argument("--kill-at", type=int, default=40, help="the step at which the group is killed")
    p.add_argument("--restart-after", type=float, default=2.0,
                   help="seconds to wait, once the other groups have trained on without it, before the killed group "
                        "is restarted")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    p.add_argument("--root-dir", default="runs")
    p.add_argument("--run-name", default=f"ft-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--timeout", type=float, default=600.0, help="give up (and kill everything) after this many seconds")
    args = p.parse_args(argv)
    root = Path(args.root_dir)
    train_args = ["--steps", str(args.steps), "--run-name", args.run_name, "--root-dir", str(root),
                  "--ft-start-groups", str(args.groups),  # they start together, whenever each is up
                  "--parallel", args.parallel, *(["--nproc", str(args.nproc)] if args.nproc > 1 else []), *extra]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    deadline = time.monotonic() + args.timeout

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    with Lighthouse(bind="127.0.0.1:0", heartbeat_timeout_ms=args.heartbeat_timeout_ms, join_timeout_ms=200) as lh:
        env["TORCHFT_LIGHTHOUSE"] = lh.address
        groups = [ReplicaGroup([sys.executable, str(HERE / "train.py"), "--ft-group", str(g), *train_args],
                               root / "gpt" / args.run_name / f"replica_group_{g}", env) for g in range(args.groups)]
        print(f"lighthouse at {lh.address}; {args.groups} replica group(s) x {args.nproc} rank(s)", flush=True)
        try:
            for group in groups:
                group.start()
            victim = groups[args.kill_group] if args.kill_group is not None else None
            if victim is not None:
                wait_until(lambda: victim.reached(args.kill_at, args.groups) or not victim.alive, groups, left(),
                           f"step {args.kill_at}")
                if not victim.alive:
                    raise RuntimeError(f"replica group {args.kill_group} ended before step {args.kill_at} with every "
                                       f"group (its last: {victim.events()[-1:]}); raise --steps or lower --kill-at")
                victim.kill()
                killed = time.time()
                print(f"killed replica group {args.kill_group} (SIGKILL) at step {args.kill_at}", flush=True)
                others = [g for g in groups if g is not victim]
                wait_until(lambda: all(_trained_without(g, killed, args.groups) or not g.alive for g in others), others,
                           left(), "the other groups training on without the killed one")
                time.sleep(args.restart_after)
                victim.start()
                print(f"restarted replica group {args.kill_group}", flush=True)
            wait_until(lambda: not any(g.alive for g in groups), groups, left(), "the end of the run")
        finally:
            for group in groups:
                group.kill()
    return _summary(groups)


def _trained_without(group: ReplicaGroup, since: float, groups: int) -> bool:
    """Whether `group` committed a step with fewer than `groups` groups after `since`."""
    return any(e["event"] == "step" and e["committed"] and e["participants"] < groups and e["time"] > since
               for e in group.events())


def _summary(groups: list[ReplicaGroup]) -> dict[str, Any]:
    summary: dict[str, Any] = {"groups": {}}
    for g, group in enumerate(groups):
        events = group.events()
        steps = [e for e in events if e["event"] == "step"]
        info = {
            "exit_code": group.returncode,
            "dir": str(group.dir),
            "starts": group.starts,
            "last_step": max((e["step"] for e in steps), default=0),
            "heals": [round(e["seconds"], 3) for e in events if e["event"] == "heal"],
            "quorums": [(e["step"], e["participants"]) for e in events if e["event"] == "quorum"],
            "not_committed": [e["step"] for e in events if e["event"] == "not_committed"],
            "replicas_lost": sum(e["lost"] for e in events if e["event"] == "replica_lost"),
            "goodput": _goodput(group.dir),
        }
        summary["groups"][g] = info
        print(f"replica group {g}: {info}", flush=True)
    return summary


def _goodput(group_dir: Path) -> dict[str, float] | None:
    """The group's last life's goodput ledger (`goodput.json`): goodput and the parts that took time."""
    path = Path(group_dir) / "goodput.json"
    if not path.is_file():
        return None
    ledger = json.loads(path.read_text())
    parts = {kind: round(seconds, 2) for kind, seconds in ledger["parts_s"].items() if seconds >= 0.01}
    return {"goodput": round(ledger["goodput"] or 0.0, 3), **parts}


if __name__ == "__main__":
    result = run()
    sys.exit(0 if all(g["exit_code"] == 0 for g in result["groups"].values()) else 1)
