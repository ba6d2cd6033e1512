"""The distributed world: mesh planning and `DistributedWorld`."""

from dream_trainer.world.plan import MESH_DIMS, MeshPlan, MeshPlanError, plan_mesh
from dream_trainer.world.fault_tolerant import FaultToleranceError, FaultTolerantWorld
from dream_trainer.world.memory import MemoryStatus
from dream_trainer.world.world import DistributedWorld

__all__ = ["MESH_DIMS", "DistributedWorld", "FaultToleranceError", "FaultTolerantWorld", "MemoryStatus", "MeshPlan", "MeshPlanError", "plan_mesh"]
