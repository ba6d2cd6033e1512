"""Mesh planning: a pure function from `DeviceParameters` and the world size to mesh dims.

No process group is needed, so every plan (and every bad plan) is testable in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dream_trainer.configs import DeviceParameters

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimension names, outermost first."""

_FIELDS = {"pp": "pipeline_parallel", "dp_replicate": "dp_replicate", "dp_shard": "dp_shard", "cp": "context_parallel", "tp": "tensor_parallel"}


class MeshPlanError(ValueError):
    """The requested mesh sizes cannot be laid out on this world."""


@dataclass(frozen=True)
class MeshPlan:
    """Resolved mesh sizes. ``dp = dp_replicate * dp_shard`` is the data-parallel degree;
    ``pp`` (pipeline stages' ranks) is the outermost dimension."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return MESH_DIMS

    @property
    def data_parallel(self) -> str:
        """``"none"``, ``"ddp"``, ``"fsdp"`` or ``"hsdp"``."""
        if self.dp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "none"


def plan_mesh(params: DeviceParameters, world_size: int, local_world_size: int | None = None) -> MeshPlan:
    """Resolve `params`' mesh sizes for `world_size` ranks (`local_world_size` per node).

    Raises:
        MeshPlanError: the sizes do not multiply to the world size, an ``"auto"`` size
            does not divide it, or a tensor-parallel group would span two nodes (``tp``
            must divide `local_world_size`). The
            message names the sizes given, the world size and a plan that would fit.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MeshPlanError(f"world_size={world_size!r} is invalid: expected an int >= 1")
    requested = {dim: getattr(params, field) for dim, field in _FIELDS.items()}
    sizes = dict(requested)
    if requested["dp_shard"] == "node":
        sizes["dp_shard"] = _node_shard(requested, world_size, local_world_size)
    fixed = 1
    auto_dim = None
    for dim, size in sizes.items():
        if size == "auto":
            auto_dim = dim
        else:
            fixed *= size  # type: ignore[operator]
    if auto_dim is not None:
        if world_size % fixed:
            raise MeshPlanError(
                _message(requested, world_size, f"the fixed sizes multiply to {fixed}, which does not divide it", local_world_size)
            )
        sizes[auto_dim] = world_size // fixed
    elif fixed != world_size:
        raise MeshPlanError(_message(requested, world_size, f"the sizes multiply to {fixed}", local_world_size))
    plan = MeshPlan(**sizes)  # type: ignore[arg-type]
    if local_world_size is not None and (plan.tp > local_world_size or local_world_size % plan.tp):
        why = "is larger than a node" if plan.tp > local_world_size else "does not divide a node"
        raise MeshPlanError(
            _message(requested, world_size, f"tensor_parallel={plan.tp} {why} ({local_world_size} ranks)", local_world_size)
        )
    block = plan.dp_shard * plan.cp * plan.tp  # consecutive ranks: one shard group
    if plan.dp_replicate > 1 and plan.dp_shard > 1 and local_world_size is not None and (
            local_world_size % block and block % local_world_size):
        raise MeshPlanError(
            f"an HSDP shard group of {block} ranks (dp_shard={plan.dp_shard} x context_parallel={plan.cp} x "
            f"tensor_parallel={plan.tp}) straddles nodes of {local_world_size} ranks (part of a node on each side). "
            "A plan that fits: DeviceParameters.HSDP(dp_shard='node') (shard within a node, replicate across nodes), "
            f"or a dp_shard whose group is a whole number of nodes"
        )
    return plan


def _node_shard(requested: dict[str, object], world_size: int, local_world_size: int | None) -> int:
    """``dp_shard="node"``: the ranks of a node that context and tensor parallelism leave."""
    node = local_world_size or world_size
    model_parallel = 1
    for dim in ("cp", "tp"):
        size = requested[dim]
        if not isinstance(size, int):
            raise MeshPlanError(f"dp_shard='node' needs fixed {_FIELDS[dim]} (got {size!r}): give it as an int")
        model_parallel *= size
    if node % model_parallel:
        raise MeshPlanError(
            _message(requested, world_size, f"context_parallel x tensor_parallel = {model_parallel} does not divide a "
                     f"node ({node} ranks)", local_world_size)
        )
    return node // model_parallel


def _message(requested: dict[str, object], world_size: int, why: str, local_world_size: int | None) -> str:
    given = ", ".join(f"{_FIELDS[dim]}={size!r}" for dim, size in requested.items())
    return (
        f"cannot lay out the device mesh ({given}) on a world of {world_size} rank(s): {why}. "
        f"A plan that fits: {_suggest(requested, world_size, local_world_size)}"
    )


def _suggest(requested: dict[str, object], world_size: int, local_world_size: int | None) -> str:
    """Keep the model-parallel sizes that divide the world (tensor parallelism within a
    node), give data parallelism the rest."""
    keep = {dim: size for dim, size in requested.items() if dim in ("pp", "cp", "tp") and isinstance(size, int)}
    if local_world_size is not None and local_world_size % keep.get("tp", 1):
        keep["tp"] = max(d for d in range(1, local_world_size + 1) if local_world_size % d == 0 and world_size % d == 0)
    model_parallel = 1
    for dim in ("tp", "cp", "pp"):
        size = keep.get(dim, 1)
        if world_size % (model_parallel * size):
            keep[dim] = 1
        else:
            model_parallel *= size
    shard_wanted = requested["dp_shard"] in ("auto", "node") or (isinstance(requested["dp_shard"], int) and requested["dp_shard"] > 1)
    dp = world_size // model_parallel
    dp_field = "dp_shard" if shard_wanted else "dp_replicate"
    other = "dp_replicate" if shard_wanted else "dp_shard"
    parts = {dp_field: dp, other: 1, "context_parallel": keep.get("cp", 1), "tensor_parallel": keep.get("tp", 1)}
    if keep.get("pp", 1) > 1:
        parts["pipeline_parallel"] = keep["pp"]
    return "DeviceParameters(" + ", ".join(f"{k}={v}" for k, v in parts.items()) + ")"
