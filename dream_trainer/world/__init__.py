"""The distributed world: mesh planning and `DistributedWorld` (the fault-tolerant world
is `dream_trainer.fault_tolerance.FaultTolerantWorld`)."""

from dream_trainer.world.plan import MESH_DIMS, MeshPlan, MeshPlanError, plan_mesh
from dream_trainer.world.memory import MemoryStatus
from dream_trainer.world.world import DistributedWorld

__all__ = ["MESH_DIMS", "DistributedWorld", "MemoryStatus", "MeshPlan", "MeshPlanError", "plan_mesh"]
