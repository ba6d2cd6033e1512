"""Where a run's ranks come from: torchrun (torchelastic), SLURM (``srun``), the
``--nproc`` launcher of `dream_trainer.entrypoint`, or one plain process.

`detect` reads the environment once and returns a `ClusterEnvironment`: this rank, the world
size, this node's ranks and the node count, and where rank 0 listens. The precedence, when
several are present (a ``torchrun`` inside a SLURM allocation, say):

1. **torchrun / torchelastic** (``RANK``/``WORLD_SIZE`` set, with ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``, as torchrun and the ``--nproc`` launcher set
   them; one missing reads as 0, or as the world size for ``LOCAL_WORLD_SIZE``): taken as
   they are.
2. **SLURM**, inside an ``srun`` step (``SLURM_STEP_ID``/``SLURM_STEPID`` with
   ``SLURM_PROCID`` and ``SLURM_NTASKS``): one task per rank. The rendezvous host is the first
   host of the step's node list, expanded the way SLURM users expect (``scontrol show
   hostnames`` when ``scontrol`` is on ``PATH``, else the same expansion done here), unless
   ``MASTER_ADDR`` is set; the port is ``MASTER_PORT``, else one derived from the job id
   (every node derives the same).
3. Otherwise **one process** (which `entrypoint` may turn into ``--nproc N`` local ranks:
   they then come back here through case 1).

A SLURM batch script itself (``sbatch``, no ``srun``) is not a step: it runs as one process.
`export` writes what torch's ``env://`` initialization reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ClusterEnvironment", "ClusterError", "detect", "expand_hostlist", "first_host", "global_rank", "in_slurm_step", "slurm_job_id", "slurm_port",
           "tasks_per_node"]


class ClusterError(RuntimeError):
    """The launch environment is inconsistent (e.g. SLURM variables that do not add up)."""


@dataclass(frozen=True)
class ClusterEnvironment:
    """This process's place in the run.

    Attributes:
        source: ``"torchrun"``, ``"slurm"`` or ``"single"``.
        rank: this process's global rank.
        world_size: ranks in the run.
        local_rank: this process's rank on its node.
        local_world_size: ranks on this node.
        node_rank: this node's index (0 .. num_nodes - 1).
        num_nodes: nodes in the run.
        master_addr: where rank 0 listens (None: torch's default, one process).
        master_port: its port (None: likewise).
        job_id: the scheduler's job id (SLURM), else None.
    """

    source: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None

    def export(self, environ: os._Environ[str] | dict[str, str] | None = None) -> None:
        """Write the variables torch's ``env://`` rendezvous reads (only those known)."""
        env = os.environ if environ is None else environ
        values = {"RANK": self.rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank,
                  "LOCAL_WORLD_SIZE": self.local_world_size, "GROUP_RANK": self.node_rank,
                  "MASTER_ADDR": self.master_addr, "MASTER_PORT": self.master_port}
        for key, value in values.items():
            if value is not None:
                env[key] = str(value)


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """This process's `ClusterEnvironment` (see the module docstring for the precedence)."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env or "RANK" in env:
        return _torchrun(env)
    if in_slurm_step(env):
        return _slurm(env)
    return ClusterEnvironment(source="single", master_addr=env.get("MASTER_ADDR"),
                              master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None)


def global_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank by the same precedence as `detect`, without resolving the
    rendezvous host (cheap: no ``scontrol``): ``RANK``, else a SLURM step's ``SLURM_PROCID``,
    else 0."""
    env = os.environ if environ is None else environ
    if env.get("RANK"):
        return _int(env, "RANK")
    if in_slurm_step(env):
        return _int(env, "SLURM_PROCID")
    return 0


def _torchrun(env: Mapping[str, str]) -> ClusterEnvironment:
    rank, world, local = (_int(env, key) if env.get(key) else default
                          for key, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    local_world = _int(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else world
    _check(rank, world, local, local_world, "RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE")
    node = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // local_world
    return ClusterEnvironment(
        source="torchrun", rank=rank, world_size=world, local_rank=local, local_world_size=local_world,
        node_rank=node, num_nodes=max(1, world // local_world), master_addr=env.get("MASTER_ADDR"),
        master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
    )


def _slurm(env: Mapping[str, str]) -> ClusterEnvironment:
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    nodes = _int(env, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in env else _int(env, "SLURM_NNODES") if "SLURM_NNODES" in env else 1
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "")
    if per_node and len(set(per_node)) > 1:
        raise ClusterError(
            f"SLURM gave the nodes different task counts ({env.get('SLURM_STEP_TASKS_PER_NODE') or env.get('SLURM_TASKS_PER_NODE')}): "
            "dream_trainer needs the same number of ranks on every node (e.g. srun --ntasks-per-node=N)"
        )
    local_world = per_node[0] if per_node else world // nodes
    if local_world * nodes != world:
        raise ClusterError(f"SLURM_NTASKS={world} is not {nodes} nodes x {local_world} tasks per node")
    _check(rank, world, local, local_world, "SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/tasks per node")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR")
    if addr is None:
        if not nodelist:
            raise ClusterError("SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is not set: cannot tell where rank 0 runs "
                               "(set MASTER_ADDR)")
        addr = first_host(nodelist)
    job = slurm_job_id(env)
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else slurm_port(job)
    return ClusterEnvironment(source="slurm", rank=rank, world_size=world, local_rank=local,
                              local_world_size=local_world, node_rank=node, num_nodes=nodes,
                              master_addr=addr, master_port=port, job_id=job)


def in_slurm_step(environ: Mapping[str, str] | None = None) -> bool:
    """Inside a task ``srun`` started (the batch script itself has no step id). Cheap: no
    ``scontrol``."""
    env = os.environ if environ is None else environ
    return ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The SLURM job this process runs in (None: not in a SLURM job)."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def slurm_port(job_id: str | None) -> int:
    """The rendezvous port of a SLURM job: 15000 + the job id's last 4 digits (the same on
    every node, different for two jobs sharing a node unless their ids end alike)."""
    digits = re.sub(r"\D", "", job_id or "")
    return 15000 + (int(digits[-4:]) if digits else 0)


def tasks_per_node(value: str) -> list[int]:
    """SLURM's compact tasks-per-node list (``"2(x3),1"``) as one count per node."""
    counts: list[int] = []
    for part in filter(None, value.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ClusterError(f"cannot read SLURM's tasks per node {value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: what ``scontrol show hostnames`` prints first
    (when ``scontrol`` is on ``PATH``), else the first of `expand_hostlist`."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()
        except (OSError, subprocess.SubprocessError) as exc:
            raise ClusterError(f"`scontrol show hostnames {nodelist}` failed: {exc}") from exc
        if out:
            return out[0]
    return expand_hostlist(nodelist)[0]


def expand_hostlist(nodelist: str) -> list[str]:
    """SLURM's compact host list (``"gpu[01-03,7],login1"``) as host names, in order
    (zero padding kept: ``gpu[08-10]`` -> gpu08, gpu09, gpu10)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        hosts += _expand_one(item.strip())
    if not hosts:
        raise ClusterError(f"empty SLURM node list {nodelist!r}")
    return hosts


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item] if item else []
    prefix, rest = item[: match.start()], item[match.end():]
    names: list[str] = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ClusterError(f"cannot read the range {part!r} in SLURM node list item {item!r}")
        width = len(low)
        for number in range(int(low), int(high or low) + 1):
            names += [prefix + str(number).zfill(width) + tail for tail in _expand_one(rest) or [""]]
    return names


def _int(env: Mapping[str, str], key: str) -> int:
    value = env[key]
    try:
        return int(value)
    except ValueError:
        raise ClusterError(f"${key}={value!r} is not an integer") from None


def _check(rank: int, world: int, local: int, local_world: int, names: str) -> None:
    if not (world >= 1 and 0 <= rank < world and local_world >= 1 and 0 <= local < local_world and world % local_world == 0):
        raise ClusterError(
            f"inconsistent launch environment ({names}): rank {rank} of {world}, local rank {local} of {local_world} "
            "per node; expected 0 <= rank < world size, 0 <= local rank < ranks per node, and the world size a "
            "multiple of the ranks per node"
        )
