"""Where a run's ranks come from: torchrun (torchelastic), SLURM (``srun``), the
``--nproc`` launcher of `dream_trainer.entrypoint`, or one plain process.

`detect` reads the environment once and returns a `ClusterEnvironment`: this rank, the world
size, this node's ranks and the node count, and where rank 0 listens. `launch_source` is the
one rule that decides which launcher started this process (``docs/cluster.md`` has it as a
table):

1. **torchrun**: every variable of `TORCHRUN_VARIABLES` is set (``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). torchrun's elastic
   agent sets all of them, and ``GROUP_RANK`` (read when present, else ``RANK //
   LOCAL_WORLD_SIZE``); so do the ``--nproc`` launcher, `dream_trainer.testing.spawn_world`
   and submitit's ``TorchDistributedEnvironment().export()``. This wins over a SLURM step:
   ``srun ... torchrun ...`` started these processes through torchrun.
2. **SLURM**, inside an ``srun`` step (``SLURM_STEP_ID``/``SLURM_STEPID`` with
   ``SLURM_PROCID`` and ``SLURM_NTASKS``): one task per rank. Some of torchrun's rank
   variables may be present too (an ``export WORLD_SIZE=...`` in the job script): they are
   ignored when they say what SLURM says, and a `ClusterError` naming both when they do not.
   The rendezvous host is ``MASTER_ADDR``, else the first host of the step's node list
   (``scontrol show hostnames`` when ``scontrol`` is on ``PATH``, else `expand_hostlist`);
   the port is ``MASTER_PORT``, else `slurm_port` of the job and step ids.
3. **One process**, when none of torchrun's rank variables is set (``entrypoint`` may turn
   it into ``--nproc N`` local ranks: they come back here through case 1). Some of them set
   without a SLURM step is a `ClusterError` naming the missing ones, at once (not after a
   rendezvous timeout).

A SLURM batch script itself (``sbatch``, no ``srun``) is not a step: it runs as one process.
`export` writes what torch's ``env://`` initialization reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PORT_BASE", "PORT_SPAN", "TORCHRUN_VARIABLES", "ClusterEnvironment", "ClusterError", "detect",
           "expand_hostlist", "first_host", "global_rank", "in_slurm_step", "launch_source", "slurm_job_id",
           "slurm_port", "tasks_per_node"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher of one process per rank sets: all of them, or the process was not started by one."""
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# MASTER_ADDR/MASTER_PORT alone are not a launcher's: a SLURM job script may set them.

PORT_BASE, PORT_SPAN = 15000, 17768
"""`slurm_port` derives ports in ``PORT_BASE .. PORT_BASE + PORT_SPAN - 1`` (15000-32767),
below Linux's ephemeral ports (32768-60999 by default)."""
_STEP_STRIDE = 10981  # coprime with PORT_SPAN: the steps of one job get distinct ports


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
    """This process's `ClusterEnvironment` (`launch_source` decides which launcher it was)."""
    env = os.environ if environ is None else environ
    source = launch_source(env)
    if source == "torchrun":
        return _torchrun(env)
    if source == "slurm":
        return _slurm(env)
    return ClusterEnvironment(source="single", master_addr=env.get("MASTER_ADDR"),
                              master_port=_port(env) if "MASTER_PORT" in env else None)


def launch_source(environ: Mapping[str, str] | None = None) -> str:
    """Which launcher started this process: ``"torchrun"``, ``"slurm"`` or ``"single"`` (the
    rule of the module docstring). Cheap: no ``scontrol``. Raises `ClusterError` for a
    partial torchrun environment outside a SLURM step, or one that contradicts the step."""
    env = os.environ if environ is None else environ
    present = [key for key in _RANK_VARIABLES if key in env]
    missing = [key for key in TORCHRUN_VARIABLES if key not in env]
    if present and not missing:
        return "torchrun"
    if in_slurm_step(env):
        if present:
            _check_agrees_with_slurm(env, present, missing)
        return "slurm"
    if present:
        raise ClusterError(
            f"torchrun's variables are only partly set: {_show(env, present)}, but not "
            f"{', '.join(missing)}. A launcher of one process per rank (torchrun, entrypoint's --nproc) "
            "sets all of them, and this is not a SLURM step either. Unset them to run one process, "
            "or start the ranks with torchrun (or srun)."
        )
    return "single"


def global_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank by the same rule as `detect`, without resolving the
    rendezvous host (cheap: no ``scontrol``): ``RANK``, a SLURM step's ``SLURM_PROCID``, or 0."""
    env = os.environ if environ is None else environ
    source = launch_source(env)
    if source == "torchrun":
        return _int(env, "RANK")
    return _int(env, "SLURM_PROCID") if source == "slurm" else 0


def _check_agrees_with_slurm(env: Mapping[str, str], present: list[str], missing: list[str]) -> None:
    rank, world, local, local_world, node, _ = _slurm_layout(env)
    slurm = {"RANK": ("SLURM_PROCID", rank), "WORLD_SIZE": ("SLURM_NTASKS", world),
             "LOCAL_RANK": ("SLURM_LOCALID", local), "LOCAL_WORLD_SIZE": ("the step's tasks on this node", local_world),
             "GROUP_RANK": ("SLURM_NODEID", node)}
    wrong = [f"{key}={env[key]} but {slurm[key][0]}={slurm[key][1]}" for key in present if _int(env, key) != slurm[key][1]]
    if wrong:
        raise ClusterError(
            f"this SLURM step's environment also holds part of torchrun's variables, and they disagree: "
            f"{'; '.join(wrong)}. It is not a torchrun process ({', '.join(missing)} not set). Unset "
            f"{', '.join(present)} (an `export` in the job script?), or start the ranks with torchrun."
        )


def _torchrun(env: Mapping[str, str]) -> ClusterEnvironment:
    rank, world, local, local_world = (_int(env, key) for key in TORCHRUN_VARIABLES[:4])
    _check(rank, world, local, local_world, "RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE")
    node, nodes = (_int(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // local_world), world // local_world
    if rank != node * local_world + local or ("GROUP_WORLD_SIZE" in env and _int(env, "GROUP_WORLD_SIZE") != nodes):
        raise ClusterError(
            f"torchrun's variables do not lay the ranks out by node: {_show(env, _RANK_VARIABLES + ('GROUP_WORLD_SIZE',))}; "
            f"expected RANK = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK on {nodes} nodes of {local_world}. "
            "dream_trainer needs the same number of ranks on every node (the same --nproc-per-node everywhere)"
        )
    return ClusterEnvironment(source="torchrun", rank=rank, world_size=world, local_rank=local,
                              local_world_size=local_world, node_rank=node, num_nodes=nodes,
                              master_addr=env["MASTER_ADDR"], master_port=_port(env))


def _slurm(env: Mapping[str, str]) -> ClusterEnvironment:
    rank, world, local, local_world, node, nodes = _slurm_layout(env)
    addr = env.get("MASTER_ADDR")
    if addr is None:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ClusterError("SLURM_STEP_NODELIST/SLURM_JOB_NODELIST is not set: cannot tell where rank 0 runs "
                               "(set MASTER_ADDR)")
        addr = first_host(nodelist)
    job = slurm_job_id(env)
    port = _port(env) if "MASTER_PORT" in env else slurm_port(job, env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))
    return ClusterEnvironment(source="slurm", rank=rank, world_size=world, local_rank=local,
                              local_world_size=local_world, node_rank=node, num_nodes=nodes,
                              master_addr=addr, master_port=port, job_id=job)


def _slurm_layout(env: Mapping[str, str]) -> tuple[int, int, int, int, int, int]:
    """(rank, world, local rank, ranks per node, node, nodes) of a SLURM step, checked: every
    id in range, and the ranks laid out by node (SLURM's default block distribution)."""
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    nodes, per_node, per_node_key = _slurm_nodes(env, world)
    if not 0 <= rank < world:
        raise ClusterError(f"SLURM_PROCID={rank} is out of range: SLURM_NTASKS={world} (expected 0 <= rank < {world})")
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else rank // per_node
    if not 0 <= node < nodes:
        raise ClusterError(f"SLURM_NODEID={node} is out of range: the step has {nodes} nodes (expected 0 .. {nodes - 1})")
    local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else rank % per_node
    if not 0 <= local < per_node:
        raise ClusterError(f"SLURM_LOCALID={local} is out of range: node {node} holds {per_node} tasks "
                           f"({per_node_key}; expected 0 .. {per_node - 1})")
    if rank != node * per_node + local:
        raise ClusterError(
            f"SLURM_PROCID={rank} is not where the block distribution puts task {local} of node {node} "
            f"({node * per_node + local} = SLURM_NODEID x {per_node} + SLURM_LOCALID): dream_trainer needs the ranks "
            "laid out by node, SLURM's default; drop srun's --distribution=cyclic/plane/arbitrary (or pass "
            "--distribution=block)"
        )
    return rank, world, local, per_node, node, nodes


def _slurm_nodes(env: Mapping[str, str], world: int) -> tuple[int, int, str]:
    """(nodes, tasks per node, the variable that said so) of a step whose nodes hold the same
    number of tasks; a `ClusterError` saying what to change for any other."""
    nodes_key = next((key for key in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES") if key in env), None)
    counts_key = next((key for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(key)), None)
    counts = tasks_per_node(env[counts_key]) if counts_key else None
    nodes = _int(env, nodes_key) if nodes_key else len(counts) if counts else 1
    if nodes < 1 or world < 1:
        raise ClusterError(f"SLURM gave {nodes} nodes and SLURM_NTASKS={world}: expected at least one of each")
    if counts is None:
        if world % nodes:
            raise ClusterError(f"SLURM_NTASKS={world} does not split evenly over {nodes} nodes "
                               "(ask srun for --ntasks-per-node=N)")
        return nodes, world // nodes, f"SLURM_NTASKS={world} over {nodes} nodes"
    shown = f"{counts_key}={env[counts_key]!r}"
    if len(counts) != nodes or sum(counts) != world:
        raise ClusterError(f"{shown} lists {len(counts)} nodes and {sum(counts)} tasks, but the step has {nodes} "
                           f"nodes ({nodes_key}) and SLURM_NTASKS={world}")
    if len(set(counts)) > 1:
        raise ClusterError(
            f"{shown} gives the nodes different task counts ({', '.join(map(str, counts))}): dream_trainer needs "
            "the same number of ranks on every node (its mesh shards within a node). Ask SLURM for "
            "--ntasks-per-node=N (with --nodes=M, not a --ntasks that does not split evenly)"
        )
    return nodes, counts[0], shown


def in_slurm_step(environ: Mapping[str, str] | None = None) -> bool:
    """Inside a task ``srun`` started (the batch script itself has no step id). Cheap: no
    ``scontrol``."""
    env = os.environ if environ is None else environ
    return ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The SLURM job this process runs in (None: not in a SLURM job)."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def slurm_port(job_id: str | None, step_id: str | None = None) -> int:
    """The rendezvous port of a SLURM step: ``PORT_BASE + (job + 10981 x step) mod PORT_SPAN``
    (15000-32767), the same on every node. The full job id counts (jobs 10000 and 20000
    differ): two steps of one number never share a port unless their job ids differ by a
    multiple of 17768, and the steps of one job never do. An id that is not a number is
    hashed (CRC-32)."""
    job, step = (_as_number(value) for value in (job_id, step_id))
    return PORT_BASE + (job + _STEP_STRIDE * step) % PORT_SPAN


def _as_number(value: str | None) -> int:
    if not value:
        return 0
    return int(value) if value.isdigit() else zlib.crc32(value.encode())


def tasks_per_node(value: str) -> list[int]:
    """SLURM's compact tasks-per-node list (``"2(x3),1"``) as one count per node."""
    counts: list[int] = []
    for part in value.split(","):
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
    (zero padding kept: ``gpu[08-10]`` -> gpu08, gpu09, gpu10). A list that is not well
    formed (a bracket never closed, a range with no host name before it, an empty item) is
    a `ClusterError` naming it."""
    hosts: list[str] = []
    for item in _hostlist_items(nodelist):
        hosts += _expand_one(item, nodelist)
    return hosts


def _hostlist_items(nodelist: str) -> list[str]:
    """The comma-separated items of a node list (commas inside brackets belong to a range)."""
    items, start, inside = [], 0, False
    for at, char in enumerate(nodelist):
        if char in "[]" and inside == (char == "["):
            why = "a '[' inside a range" if inside else "a ']' with no '[' before it"
            raise ClusterError(f"malformed SLURM node list {nodelist!r}: {why} (at character {at})")
        inside = (char == "[") or (inside and char != "]")
        if char == "," and not inside:
            items.append(nodelist[start:at].strip())
            start = at + 1
    if inside:
        raise ClusterError(f"malformed SLURM node list {nodelist!r}: a '[' that is never closed")
    items.append(nodelist[start:].strip())
    if not all(items):
        raise ClusterError(f"malformed SLURM node list {nodelist!r}: an empty host name")
    return items


def _expand_one(item: str, nodelist: str) -> list[str]:
    texts = re.split(r"\[([^\]]*)\]", item)  # host-name text, range, text, range, ..., text
    for text in texts[0::2]:
        if not re.fullmatch(r"[A-Za-z0-9._-]*", text):
            raise ClusterError(f"malformed SLURM node list {nodelist!r}: {text!r} is not part of a host name")
    if len(texts) > 1 and not texts[0]:
        raise ClusterError(f"malformed SLURM node list {nodelist!r}: the range [{texts[1]}] has no host name before it")
    names = [texts[0]]
    for body, text in zip(texts[1::2], texts[2::2]):
        names = [name + number + text for name in names for number in _range_numbers(body, item)]
    return names


def _range_numbers(body: str, item: str) -> list[str]:
    numbers: list[str] = []
    for part in body.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or int(high or low) < int(low):
            raise ClusterError(f"cannot read the range {part!r} in SLURM node list item {item!r}")
        numbers += [str(number).zfill(len(low)) for number in range(int(low), int(high or low) + 1)]
    return numbers


def _int(env: Mapping[str, str], key: str) -> int:
    value = env[key]
    try:
        return int(value)
    except ValueError:
        raise ClusterError(f"${key}={value!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> int:
    port = _int(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise ClusterError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return port


def _show(env: Mapping[str, str], keys: tuple[str, ...] | list[str]) -> str:
    return ", ".join(f"{key}={env[key]}" for key in keys if key in env)


def _check(rank: int, world: int, local: int, local_world: int, names: str) -> None:
    if not (world >= 1 and 0 <= rank < world and local_world >= 1 and 0 <= local < local_world and world % local_world == 0):
        raise ClusterError(
            f"inconsistent launch environment ({names}): rank {rank} of {world}, local rank {local} of {local_world} "
            "per node; expected 0 <= rank < world size, 0 <= local rank < ranks per node, and the world size a "
            "multiple of the ranks per node"
        )
