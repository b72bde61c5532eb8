"""What the trainer does for a job that loses a node, in one process: the one line a failed
collective ends a run with (health.collective_failure), over a world of one, and the store a
restarted torchrun worker joins with. The namespaced-cluster tests (tests/cluster/test_faults.py)
meet both with real lost nodes, cut links and restarts."""

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from gpt2forge.parallel import distributed, health

TIMEOUT = datetime.timedelta(seconds=12)


@pytest.fixture()
def world_of_one(monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(health, "_nodes", [("node0", "10.77.0.1")])
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("said", ["Connection closed by peer [10.77.0.2]:63662",
                                  "Read error [10.77.0.2]:41603: Connection reset by peer"])
def test_a_closed_connection_names_the_node_and_its_ranks(world_of_one, monkeypatch, said):
    monkeypatch.setattr(health, "_nodes", [("node0", "10.77.0.1"), ("node1", "10.77.0.2"), ("node0", "10.77.0.1"),
                                           ("node1", "10.77.0.2")])
    gloo = RuntimeError(f"[../third_party/gloo/gloo/transport/tcp/pair.cc:553] {said}. This is typically caused by "
                        "a remote worker crashing.")
    line = health.collective_failure(gloo, TIMEOUT, "step 5 (update 5)")
    assert line == ("on node0 during step 5 (update 5): lost the connection to node1 (10.77.0.2: rank 1, 3): a "
                    "process there exited or was killed (its own log or torchrun's summary says why) "
                    f"({said}; collective timeout 12 s, GPT2FORGE_DIST_TIMEOUT_MIN)")


def test_a_timeout_names_the_ranks_that_do_not_check_in(world_of_one, monkeypatch):
    monkeypatch.setattr(health, "CHECK_IN_S", 0.5)
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 12000ms "
                        "for recv operation to complete")
    said = "Timed out waiting 12000ms for recv operation to complete; collective timeout 12 s, " \
           "GPT2FORGE_DIST_TIMEOUT_MIN"
    # Alone, every rank checked in: the line says so rather than inventing a culprit.
    assert health.collective_failure(gloo, TIMEOUT, "step 3 (update 3)") == (
        f"on node0 during step 3 (update 3): a collective failed, yet every rank is still running: a slow rank or "
        f"link? ({said})")
    monkeypatch.setattr(health, "_ranks_not_checking_in", lambda wait_s: [1])
    monkeypatch.setattr(health, "_nodes", [("node0", "10.77.0.1"), ("node1", "10.77.0.2")])
    assert health.collective_failure(gloo, TIMEOUT, "step 3") == (
        "on node0 during step 3: a collective failed; not answering: node1 (10.77.0.2: rank 1): their processes "
        f"exited, or their node or its link is down ({said})")
    monkeypatch.setattr(health, "_ranks_not_checking_in", lambda wait_s: None)  # the store is out of reach
    assert health.collective_failure(gloo, TIMEOUT, "") == (
        f"on node0: a collective failed and the job's store at {os.environ.get('MASTER_ADDR', '?')}:"
        f"{os.environ.get('MASTER_PORT', '?')} does not answer either: this node lost its network, or the node of "
        f"rank 0 went away ({said})")


def test_a_store_that_does_not_answer_counts_as_out_of_reach_within_the_wait(world_of_one, monkeypatch):
    class Unanswered:  # a TCPStore client behind a link that drops everything blocks past its timeout
        def set_timeout(self, timeout):
            pass

        def set(self, key, value):
            time.sleep(30)

        def check(self, keys):  # reached after the test, in the abandoned thread: answers nothing
            return False

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: Unanswered())
    t0 = time.monotonic()
    assert health._ranks_not_checking_in(0.5) is None
    assert time.monotonic() - t0 < 5


def test_other_errors_are_not_collective_failures(world_of_one):
    assert health.collective_failure(RuntimeError("CUDA out of memory"), TIMEOUT, "step 1") is None
    assert health.collective_failure(ValueError("Timed out waiting"), TIMEOUT, "step 1") is not None  # by message
    dist.destroy_process_group()
    try:  # outside a distributed run nothing is a collective failure
        assert health.collective_failure(RuntimeError("Connection closed by peer [1.2.3.4]:5"), TIMEOUT, "") is None
    finally:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@pytest.mark.slow
def test_the_collective_timeout_takes_fractions_of_a_minute():
    env = {**os.environ, "GPT2FORGE_DIST_TIMEOUT_MIN": "0.25"}
    out = subprocess.run([sys.executable, "-c", "from gpt2forge.parallel.distributed import TIMEOUT; "
                          "print(TIMEOUT.total_seconds())"], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "15.0", out.stderr


def test_restarted_workers_get_keys_of_their_own_attempt_in_torchruns_shared_store(monkeypatch):
    """Under c10d rendezvous torchrun's workers share its store and torch reuses their keys across
    restarts (pytorch/pytorch#135712: restarted workers dialled the previous attempt's addresses)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert distributed._store_of_this_attempt() is None  # torch's own env:// store is right then
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        distributed._store_of_this_attempt().set("rank0_address", f"port of attempt {attempt}")
    assert server.get("/gpt2forge/attempt_0/rank0_address") == b"port of attempt 0"
    assert server.get("/gpt2forge/attempt_1/rank0_address") == b"port of attempt 1"
