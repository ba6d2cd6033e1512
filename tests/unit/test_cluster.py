"""The launch environment: torchrun, a simulated SLURM allocation (fake SLURM_* variables and a
stub `scontrol` on PATH), and their precedence."""

from __future__ import annotations

import os
import re
import stat

import pytest

from dream_trainer.cluster import (PORT_BASE, PORT_SPAN, ClusterError, detect, expand_hostlist, global_rank, slurm_port,
                                   tasks_per_node)


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
    with pytest.raises(ClusterError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(x2\)' lists 2 nodes and 4 tasks, but .*SLURM_NTASKS=5"):
        detect(slurm_env(0, SLURM_NTASKS="5"))
    with pytest.raises(ClusterError, match=r"\$SLURM_PROCID='zero' is not an integer"):
        detect(slurm_env(0, SLURM_PROCID="zero"))
    env = slurm_env(0)
    del env["SLURM_STEP_NODELIST"], env["SLURM_JOB_NODELIST"]
    with pytest.raises(ClusterError, match="set MASTER_ADDR"):
        detect(env)


def test_torchrun_multi_node_variables_give_the_node(no_scontrol):
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"})
    assert (env.node_rank, env.num_nodes, env.local_world_size) == (1, 2, 2)
    with pytest.raises(ClusterError, match="rank 2 of 2"):
        detect(torchrun_env(2, 2, 2))


def torchrun_env(rank: int, world: int, per_node: int, **extra: str) -> dict[str, str]:
    """What torchrun's elastic agent gives worker `rank` (torch/distributed/elastic/agent/server)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
            "GROUP_WORLD_SIZE": str(world // per_node), "ROLE_RANK": str(rank), "MASTER_ADDR": "node01",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", **extra}


# The step of the issue: task 7 of 8 on 4 nodes, with a stray WORLD_SIZE from the batch script.
STEP_OF_8 = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "7", "SLURM_NTASKS": "8",
             "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
             "SLURM_STEP_NODELIST": "gpu-[001-003,010]", "SLURM_LOCALID": "1", "SLURM_NODEID": "3"}


# ---------------------------------------------------------------------- which launcher: one rule
def test_a_lone_world_size_exported_in_a_job_script_does_not_hide_the_slurm_step(no_scontrol):
    env = detect({**STEP_OF_8, "WORLD_SIZE": "8"})
    assert (env.source, env.rank, env.world_size, env.local_rank, env.node_rank, env.num_nodes) == ("slurm", 7, 8, 1, 3, 4)
    assert (env.master_addr, env.master_port) == ("gpu-001", slurm_port("123456", "0"))
    assert global_rank({**STEP_OF_8, "WORLD_SIZE": "8"}) == 7
    # Any of torchrun's rank variables that agree with the step are ignored alike.
    agreeing = {**STEP_OF_8, "RANK": "7", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "3"}
    assert (detect(agreeing).source, detect(agreeing).rank) == ("slurm", 7)


def test_part_of_torchrun_that_contradicts_the_step_fails_at_once_naming_both(no_scontrol):
    with pytest.raises(ClusterError, match=r"WORLD_SIZE=16 but SLURM_NTASKS=8.*Unset WORLD_SIZE"):
        detect({**STEP_OF_8, "WORLD_SIZE": "16"})
    with pytest.raises(ClusterError, match=r"RANK=0 but SLURM_PROCID=7; GROUP_RANK=0 but SLURM_NODEID=3"):
        global_rank({**STEP_OF_8, "RANK": "0", "GROUP_RANK": "0"})
    # torchrun's full set minus its rendezvous is not torchrun either: the missing ones are named.
    partial = {**STEP_OF_8, **torchrun_env(0, 2, 2)}
    del partial["MASTER_ADDR"], partial["MASTER_PORT"]
    with pytest.raises(ClusterError, match=r"RANK=0 but SLURM_PROCID=7.*\(MASTER_ADDR, MASTER_PORT not set\)"):
        detect(partial)


def test_torchrun_is_its_full_set_and_wins_inside_a_slurm_step(no_scontrol):
    # srun --ntasks-per-node=1 torchrun --nproc-per-node=2 ...: torchrun started these processes.
    env = detect({**STEP_OF_8, **torchrun_env(5, 8, 2)})
    assert (env.source, env.rank, env.local_rank, env.node_rank, env.num_nodes) == ("torchrun", 5, 1, 2, 4)
    assert (env.master_addr, env.master_port) == ("node01", 29500)
    assert global_rank({**STEP_OF_8, **torchrun_env(5, 8, 2)}) == 5
    # The --nproc launcher, spawn_world and submitit set the same set without GROUP_RANK: the node is RANK // LOCAL_WORLD_SIZE.
    submitit = {k: v for k, v in torchrun_env(3, 4, 2).items() if not k.startswith(("GROUP_", "ROLE_", "TORCHELASTIC"))}
    assert (detect(submitit).source, detect(submitit).node_rank) == ("torchrun", 1)


def test_part_of_torchrun_without_a_slurm_step_names_what_is_missing():
    with pytest.raises(ClusterError, match=r"only partly set: WORLD_SIZE=2, but not RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, "
                                           r"MASTER_ADDR, MASTER_PORT"):
        detect({"WORLD_SIZE": "2"})
    with pytest.raises(ClusterError, match=r"only partly set: RANK=1, .*but not MASTER_ADDR"):
        global_rank({k: v for k, v in torchrun_env(1, 2, 2).items() if k != "MASTER_ADDR"})
    # A batch script (no step) with a stray variable is no different.
    with pytest.raises(ClusterError, match="only partly set: WORLD_SIZE=8"):
        detect({k: v for k, v in {**STEP_OF_8, "WORLD_SIZE": "8"}.items() if k != "SLURM_STEP_ID"})
    assert detect({"MASTER_ADDR": "h", "MASTER_PORT": "1234"}).source == "single"  # a rendezvous alone is no launcher


def test_torchrun_nodes_of_different_sizes_are_refused():
    # Nodes 0 and 1 ran --nproc-per-node 2, node 2 --nproc-per-node 4: rank 5 is node 2's second rank.
    with pytest.raises(ClusterError, match=r"do not lay the ranks out by node: RANK=5, .*GROUP_RANK=2.*same --nproc-per-node"):
        detect(torchrun_env(5, 8, 4, LOCAL_RANK="1", GROUP_RANK="2", GROUP_WORLD_SIZE="3"))
    with pytest.raises(ClusterError, match="GROUP_WORLD_SIZE=3"):
        detect(torchrun_env(3, 4, 2, GROUP_WORLD_SIZE="3"))


# ---------------------------------------------------------------------- parsing SLURM's variables
@pytest.mark.parametrize(("nodelist", "why"), [
    ("gpu[1-2", "a '\\[' that is never closed"), ("[1-2]", r"the range \[1-2\] has no host name before it"),
    ("gpu1-2]", "a '\\]' with no '\\[' before it"), ("gpu[1-[2]]", "a '\\[' inside a range"),
    ("a,,b", "an empty host name"), ("gpu[1-2],", "an empty host name"), ("gpu 1", "'gpu 1' is not part of a host name"),
])
def test_malformed_node_lists_are_errors_naming_the_list(nodelist, why):
    with pytest.raises(ClusterError, match=rf"malformed SLURM node list {re.escape(repr(nodelist))}: {why}"):
        expand_hostlist(nodelist)


def test_bad_ranges_in_a_node_list_are_errors():
    for bad in ("gpu[3-1]", "gpu[]", "gpu[1-]"):
        with pytest.raises(ClusterError, match=r"cannot read the range"):
            expand_hostlist(bad)
    assert expand_hostlist("gpu-[001-003,010]") == ["gpu-001", "gpu-002", "gpu-003", "gpu-010"]
    assert expand_hostlist(" a.b_c-1 , d[9-10]e") == ["a.b_c-1", "d9e", "d10e"]


def test_slurm_ids_out_of_range_are_errors(no_scontrol):
    with pytest.raises(ClusterError, match=r"SLURM_NODEID=9 is out of range: the step has 4 nodes"):
        detect({**STEP_OF_8, "SLURM_NODEID": "9"})
    with pytest.raises(ClusterError, match=r"SLURM_PROCID=8 is out of range: SLURM_NTASKS=8"):
        detect({**STEP_OF_8, "SLURM_PROCID": "8"})
    with pytest.raises(ClusterError, match=r"SLURM_LOCALID=2 is out of range: node 3 holds 2 tasks \(SLURM_STEP_TASKS_PER_NODE"):
        detect({**STEP_OF_8, "SLURM_LOCALID": "2"})
    # srun --distribution=cyclic: task 1 on node 1, not node 0. The mesh needs ranks by node.
    with pytest.raises(ClusterError, match=r"SLURM_PROCID=1 is not where the block distribution puts .*--distribution=block"):
        detect(slurm_env(1, SLURM_NODEID="1", SLURM_LOCALID="0"))
    with pytest.raises(ClusterError, match=r"lists 3 nodes and 6 tasks, but the step has 4 nodes"):
        detect({**STEP_OF_8, "SLURM_STEP_TASKS_PER_NODE": "2(x3)"})


def test_nodes_with_different_task_counts_are_refused_saying_what_to_change(no_scontrol):
    uneven = {**STEP_OF_8, "SLURM_NTASKS": "7", "SLURM_PROCID": "6", "SLURM_LOCALID": "0",
              "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
    with pytest.raises(ClusterError, match=r"SLURM_STEP_TASKS_PER_NODE='2\(x3\),1' gives the nodes different task "
                                           r"counts \(2, 2, 2, 1\).*--ntasks-per-node=N"):
        detect(uneven)


def test_derived_ports_differ_between_jobs_and_steps_that_could_share_a_node(no_scontrol):
    assert slurm_port("10000") != slurm_port("20000")  # 15000 + the last 4 digits gave both 15000
    assert slurm_port("4242") == slurm_port("4242", "0") == 15000 + 4242
    # Jobs with nearby ids (those that run at the same time) never share a port, nor do one job's steps.
    ids = range(123_000, 123_000 + PORT_SPAN)
    assert len({slurm_port(str(job)) for job in ids}) == PORT_SPAN
    assert len({slurm_port("123456", str(step)) for step in range(64)}) == 64
    assert all(PORT_BASE <= slurm_port(str(job), str(step)) < min(PORT_BASE + PORT_SPAN, 32768)
               for job in (0, 1, 99_999_999) for step in (0, 1, 7))
    assert PORT_BASE <= slurm_port("not-a-number") < PORT_BASE + PORT_SPAN
    # Every task of a step derives the same port; another step of the job, another one.
    ports = {detect({**slurm_env(i), "SLURM_JOB_ID": "20000"}).master_port for i in range(4)}
    assert ports == {slurm_port("20000", "0")}
    assert detect({**slurm_env(0), "SLURM_JOB_ID": "20000", "SLURM_STEP_ID": "1"}).master_port not in ports
    with pytest.raises(ClusterError, match=r"MASTER_PORT=70000 is not a TCP port"):
        detect(slurm_env(0, MASTER_PORT="70000"))


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
