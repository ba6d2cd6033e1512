"""The launch environment: torchrun, a simulated SLURM allocation (fake SLURM_* variables and a
stub `scontrol` on PATH), and their precedence."""

from __future__ import annotations

import os
import stat

import pytest

from dream_trainer.cluster import ClusterError, detect, expand_hostlist, slurm_port, tasks_per_node


def slurm_env(procid: int, nodes: int = 2, per_node: int = 2, **extra: str) -> dict[str, str]:
    """What srun gives task `procid` of a job on `nodes` nodes with `per_node` tasks each."""
    return {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(nodes * per_node), "SLURM_LOCALID": str(procid % per_node),
        "SLURM_NODEID": str(procid // per_node), "SLURM_NNODES": str(nodes), "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_STEP_NODELIST": "gpu[08-09]",
        "SLURM_JOB_NODELIST": "gpu[08-09]", **extra,
    }


def stub_scontrol(monkeypatch, tmp_path, body: str):
    """An `scontrol` first on PATH that logs its arguments (the returned file), then runs `body`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    stub = bin_dir / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {log}\n{body}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


@pytest.fixture
def no_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))


def test_hostlists_expand_the_way_slurm_does():
    assert expand_hostlist("gpu[08-10]") == ["gpu08", "gpu09", "gpu10"]
    assert expand_hostlist("gpu[01-02,7],login1") == ["gpu01", "gpu02", "gpu7", "login1"]
    assert expand_hostlist("rack[1-2]-node[1-2]") == ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]
    assert expand_hostlist("a,b") == ["a", "b"]
    with pytest.raises(ClusterError, match="cannot read the range 'x-3'"):
        expand_hostlist("gpu[x-3]")
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ClusterError, match="tasks per node"):
        tasks_per_node("two")


def test_a_slurm_step_gives_ranks_nodes_and_the_first_host(no_scontrol):
    envs = [detect(slurm_env(i)) for i in range(4)]
    assert [e.rank for e in envs] == [0, 1, 2, 3]
    assert [e.local_rank for e in envs] == [0, 1, 0, 1]
    assert [e.node_rank for e in envs] == [0, 0, 1, 1]
    assert {(e.source, e.world_size, e.local_world_size, e.num_nodes) for e in envs} == {("slurm", 4, 2, 2)}
    assert {(e.master_addr, e.master_port) for e in envs} == {("gpu08", slurm_port("4242"))}
    exported: dict[str, str] = {}
    envs[3].export(exported)
    assert exported == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "GROUP_RANK": "1", "MASTER_ADDR": "gpu08", "MASTER_PORT": str(slurm_port("4242"))}


def test_the_first_host_comes_from_scontrol_when_it_is_on_path(monkeypatch, tmp_path):
    log = stub_scontrol(monkeypatch, tmp_path, "echo node-b.cluster\necho node-a.cluster")
    env = detect(slurm_env(1))
    assert env.master_addr == "node-b.cluster"
    assert log.read_text().split() == ["show", "hostnames", "gpu[08-09]"]


def test_explicit_variables_win_over_slurm(no_scontrol):
    # MASTER_ADDR/PORT set by the job script win over the node list and the derived port.
    env = detect(slurm_env(0, MASTER_ADDR="10.0.0.5", MASTER_PORT="29400"))
    assert (env.master_addr, env.master_port) == ("10.0.0.5", 29400)
    # torchrun inside an allocation: its variables win (it started these processes).
    both = {**slurm_env(3), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    env = detect(both)
    assert (env.source, env.rank, env.world_size, env.num_nodes) == ("torchrun", 1, 2, 1)
    # The batch script itself (no srun step) is one process.
    batch = {k: v for k, v in slurm_env(0).items() if k != "SLURM_STEP_ID"}
    assert detect(batch).source == "single" and detect(batch).world_size == 1
    assert detect({}).source == "single"


def test_slurm_variables_that_do_not_add_up_fail_clearly(no_scontrol):
    with pytest.raises(ClusterError, match=r"different task counts \(2,1\)"):
        detect(slurm_env(0, SLURM_STEP_TASKS_PER_NODE="2,1"))
    with pytest.raises(ClusterError, match=r"SLURM_NTASKS=5 is not 2 nodes x 2 tasks per node"):
        detect(slurm_env(0, SLURM_NTASKS="5"))
    with pytest.raises(ClusterError, match=r"\$SLURM_PROCID='zero' is not an integer"):
        detect(slurm_env(0, SLURM_PROCID="zero"))
    with pytest.raises(ClusterError, match="rank 4 of 4"):
        detect(slurm_env(4))
    env = slurm_env(0)
    del env["SLURM_STEP_NODELIST"], env["SLURM_JOB_NODELIST"]
    with pytest.raises(ClusterError, match="set MASTER_ADDR"):
        detect(env)


def test_torchrun_multi_node_variables_give_the_node(no_scontrol):
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"})
    assert (env.node_rank, env.num_nodes, env.local_world_size) == (1, 2, 2)
    with pytest.raises(ClusterError, match="rank 2 of 2"):
        detect({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_a_world_reads_a_slurm_step(monkeypatch, no_scontrol):
    from dream_trainer import DeviceParameters
    from dream_trainer.world.world import DistributedWorld

    for key, value in slurm_env(3).items():
        monkeypatch.setenv(key, value)
    world = DistributedWorld(DeviceParameters.HSDP(dp_shard=2))
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == (3, 4, 1, 2)
    assert (world.plan.dp_replicate, world.plan.dp_shard) == (2, 2)


# ---------------------------------------------------------------------- the mesh across nodes
def test_hsdp_shards_within_a_node_and_replicates_across_nodes_by_default():
    from dream_trainer import DeviceParameters
    from dream_trainer.world.plan import plan_mesh

    plan = plan_mesh(DeviceParameters.HSDP(), world_size=4, local_world_size=2)
    assert (plan.dp_replicate, plan.dp_shard, plan.tp) == (2, 2, 1)
    plan = plan_mesh(DeviceParameters.HSDP(tensor_parallel=2), world_size=16, local_world_size=8)
    assert (plan.dp_replicate, plan.dp_shard, plan.tp) == (2, 4, 2)
    plan = plan_mesh(DeviceParameters.HSDP(), world_size=2, local_world_size=None)  # one node: plain FSDP
    assert (plan.dp_replicate, plan.dp_shard) == (1, 2)
    # A shard group of whole nodes is a choice (memory over bandwidth), not a mistake.
    plan = plan_mesh(DeviceParameters.HSDP(dp_shard=8), world_size=16, local_world_size=4)
    assert (plan.dp_replicate, plan.dp_shard) == (2, 8)


def test_a_plan_that_crosses_a_node_where_it_should_not_is_refused_with_a_suggestion():
    from dream_trainer import DeviceParameters
    from dream_trainer.world.plan import MeshPlanError, plan_mesh

    with pytest.raises(MeshPlanError, match=r"shard group of 3 ranks .* straddles nodes of 4 ranks.*dp_shard='node'"):
        plan_mesh(DeviceParameters.HSDP(dp_shard=3), world_size=12, local_world_size=4)
    with pytest.raises(MeshPlanError, match=r"tensor_parallel=8 is larger than a node \(4 ranks\).*tensor_parallel=4"):
        plan_mesh(DeviceParameters(dp_replicate="auto", tensor_parallel=8), world_size=16, local_world_size=4)
    with pytest.raises(MeshPlanError, match=r"context_parallel x tensor_parallel = 3 does not divide a node \(4 ranks\)"):
        plan_mesh(DeviceParameters.HSDP(tensor_parallel=3), world_size=12, local_world_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel='node'"):
        DeviceParameters(tensor_parallel="node")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- requeue and run names
def test_requeue_is_rank_zero_only_and_says_why_it_did_not_happen(monkeypatch, tmp_path, caplog):
    from dream_trainer.launch import requeue_slurm_job
    from dream_trainer.run_identity import default_run_name

    assert not default_run_name().startswith("slurm-")  # a timestamp outside SLURM
    assert not requeue_slurm_job()  # not a SLURM job: a warning, nothing run
    assert "not a SLURM job" in caplog.text
    log = stub_scontrol(monkeypatch, tmp_path, 'if [ "$JOB_FAILS" = 1 ]; then echo "no such job" >&2; exit 1; fi')
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert default_run_name() == "slurm-77"  # the same after a requeue: the job resumes its run
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # a task of an srun step
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert not requeue_slurm_job() and not log.exists()  # not rank 0
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert requeue_slurm_job() and log.read_text().split() == ["requeue", "77"]
    monkeypatch.setenv("JOB_FAILS", "1")
    assert not requeue_slurm_job()
    assert "no such job" in caplog.text


def test_a_torchrun_run_is_named_after_its_rendezvous_id_and_restarts_without_one_warn(monkeypatch, caplog):
    from dream_trainer.run_identity import default_run_name

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "my-run")  # --rdzv-id, kept by every restart
    assert default_run_name() == "torchrun-my-run"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default without --rdzv-id
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert not default_run_name().startswith("torchrun-") and "max-restarts" not in caplog.text
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    default_run_name()
    assert "starts over instead of resuming" in caplog.text


def test_ranks_are_named_with_node_and_host_and_communication_errors_are_told_apart():
    import torch.distributed as dist

    from dream_trainer.cluster import ClusterEnvironment
    from dream_trainer.world.rendezvous import Roster, is_communication_error

    roster = Roster(ClusterEnvironment("torchrun", rank=0, world_size=4, local_world_size=2, num_nodes=2),
                    {0: (0, "gpu-1"), 2: (1, "gpu-2")})
    assert roster.name(2) == "rank 2 (node 1, host gpu-2)"
    assert roster.name(3) == "rank 3 (node 1, host gpu-2)"  # never signed in: its node's host
    assert Roster(roster.cluster, {}).name(3) == "rank 3 (node 1)"
    assert is_communication_error(dist.DistNetworkError("x"))
    assert is_communication_error(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert not is_communication_error(ValueError("boom")) and not is_communication_error(RuntimeError("shape mismatch"))


def test_the_shared_root_check_names_the_nodes_that_cannot_see_it(tmp_path):
    from dream_trainer.checkpoint import check_shared_root
    from dream_trainer.errors import CheckpointError

    class OneRankOfTwoNodes:
        """Rank 0 of a 2-node world whose other node answers `other` (the gather's second view)."""

        rank = local_rank = 0

        def __init__(self, other: bool):
            self.other, self.barriers = other, 0

        def broadcast_object(self, obj, src=0):
            return obj

        def all_gather_object(self, obj):
            return [obj, (1, "node-b", self.other)]

        def barrier(self):
            self.barriers += 1

    world = OneRankOfTwoNodes(other=True)
    check_shared_root(world, tmp_path / "ckpt", node_rank=0)
    assert (tmp_path / "ckpt").is_dir() and not list((tmp_path / "ckpt").iterdir())  # the marker is gone
    assert world.barriers == 2
    with pytest.raises(CheckpointError, match=r"is not the same directory on every node: node 1 \(node-b\)"):
        check_shared_root(OneRankOfTwoNodes(other=False), tmp_path / "ckpt", node_rank=0)
