"""The preflight's all-reduce has a timeout of its own (health.PROBE_TIMEOUT), so a backend that
never moves data fails in seconds rather than after NCCL's watchdog (the collective timeout), and
its failure classifier (health.backend_failure_hint) knows NCCL's messages as well as gloo's; a
NCCL communicator that cannot connect when the group forms is one line too. Over a world of one
(gloo) with the failures injected."""

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from gpt2forge.core.errors import UsageError
from gpt2forge.parallel import distributed, health
from gpt2forge.parallel.distributed import DistEnv

PROBE = datetime.timedelta(seconds=1)


@pytest.fixture()
def world_of_one(monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(health, "_nodes", [])
    yield
    dist.destroy_process_group()


def test_an_all_reduce_that_never_completes_fails_within_the_probes_own_timeout(world_of_one, monkeypatch):
    released = threading.Event()

    def stuck(tensor, *args, **kwargs):  # a NCCL transport that never connects: only its watchdog would end it
        released.wait(20)
        raise RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, "
                           "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600039 milliseconds before timing out.")

    monkeypatch.setattr(dist, "all_reduce", stuck)
    t0 = time.perf_counter()
    with pytest.raises(UsageError) as failed:
        health.preflight(torch.device("cpu"), probe_timeout=PROBE)
    released.set()
    assert time.perf_counter() - t0 < 10
    assert str(failed.value) == (
        "preflight on rank 0: the ranks met, but an all-reduce over gloo did not complete correctly within 1 s (no "
        "answer: it is still waiting); check the network between the nodes (GLOO_SOCKET_IFNAME=<interface>) "
        "(GPT2FORGE_PREFLIGHT_PROBE_S sets the limit)")


def test_a_failing_all_reduce_says_the_backends_words(world_of_one, monkeypatch):
    def refused(tensor, *args, **kwargs):
        raise dist.DistBackendError("[../third_party/gloo/gloo/transport/tcp/pair.cc:144] Connection refused")

    monkeypatch.setattr(dist, "all_reduce", refused)
    with pytest.raises(UsageError, match=r"within 1 s \(Connection refused\); gloo cannot reach the other nodes: "
                                         r"set GLOO_SOCKET_IFNAME=<interface>"):
        health.preflight(torch.device("cpu"), probe_timeout=PROBE)


def test_a_healthy_world_passes(world_of_one, capsys):
    health.preflight(torch.device("cpu"), probe_timeout=PROBE)
    assert "Preflight: 1 ranks passed a barrier and an all-reduce over gloo" in capsys.readouterr().out


NCCL = "cpu:gloo,cuda:nccl"
NCCL_ERROR = "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, "


@pytest.mark.parametrize("message, hint", [
    (NCCL_ERROR + "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\n"
     "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.\n"
     "Last error:\nsocketStartConnect: Connect to 10.77.0.2<43215> failed : Software caused connection abort",
     "NCCL's sockets cannot reach the other nodes: set NCCL_SOCKET_IFNAME=<interface>"),
    (NCCL_ERROR + "remote process exited or there was a network error, NCCL version 2.27.3\nncclRemoteError: A call "
     "failed possibly due to a network error or a remote process exiting prematurely.\nLast error:\n"
     "NET/IB : Got completion from peer 10.77.0.2<36181> with status=12 opcode=0 len=0 vendor err 129",
     "the InfiniBand transport failed: check the links (ibstat), or run over sockets with NCCL_IB_DISABLE=1"),
    (NCCL_ERROR + "invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.27.3\nncclInvalidUsage: "
     "This usually reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 "
     "both on CUDA device 1000", "two ranks share one GPU: start one process per GPU"),
    (NCCL_ERROR + "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\n"
     "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.\n"
     "Last error:\nError while creating shared memory segment /dev/shm/nccl-8HLx2b (size 9637888)",
     "a system call of NCCL failed: in a container, /dev/shm may be too small"),
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
     "Timeout(ms)=600000) ran for 600039 milliseconds before timing out.",
     "no data moved: the ranks met but their GPUs cannot reach each other"),
    (NCCL_ERROR + "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\n"
     "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'",
     "a CUDA error inside NCCL: check the GPUs (nvidia-smi)"),
])
def test_the_classifier_knows_nccls_messages(message, hint):
    said = health.first_words(dist.DistBackendError(message))
    assert said != NCCL_ERROR.strip() and "ProcessGroupNCCL.cpp" not in said  # the line that says what happened
    assert health.backend_failure_hint(said, NCCL).startswith(hint)


@pytest.mark.parametrize("message, hint", [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.77.0.2]:63662",
     "a peer's process exited"),
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 120000ms for recv operation "
     "to complete", "check the network between the nodes"),
])
def test_the_classifier_still_knows_gloos(message, hint):
    assert health.backend_failure_hint(health.first_words(RuntimeError(message)), "gloo").startswith(hint)


def test_a_nccl_group_that_cannot_connect_is_one_line(fake_cuda, monkeypatch):
    def cannot_connect(*args, **kwargs):
        raise dist.DistBackendError(
            NCCL_ERROR + "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\n"
            "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.\n"
            "Last error:\nsocketStartConnect: Connect to 10.77.0.2<43215> failed : No route to host")

    monkeypatch.setattr(dist, "init_process_group", cannot_connect)
    monkeypatch.setattr(distributed, "preflight", lambda device: pytest.fail("no group, no preflight"))
    env = DistEnv(rank=1, local_rank=0, world_size=2)
    with pytest.raises(UsageError) as failed:
        distributed.init_process_group(env, torch.device("cuda", 0))
    assert str(failed.value).startswith(
        "joining the process group over cpu:gloo,cuda:nccl failed (socketStartConnect: Connect to 10.77.0.2<43215> "
        "failed : No route to host); NCCL's sockets cannot reach the other nodes: set NCCL_SOCKET_IFNAME=")
