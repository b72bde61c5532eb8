"""The namespaced cluster itself: nodes with their own names and addresses that reach each other
over their veths, netem faults that do what they say, and nothing left behind."""

import subprocess
import sys
import time

import netns
import pytest
from cluster_fixtures import cluster_fixture  # noqa: F401  (the fixture `cluster`)

# A TCP round trip from the node it runs on to `host`:`port` (a listener on the other node), in ms;
# "timeout" when nothing answers within 2 s, nothing (and the error on stderr) on another error.
CONNECT = """
import socket, sys, time
t0 = time.perf_counter()
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print(f"{(time.perf_counter() - t0) * 1000:.1f}")
except OSError as exc:
    print("timeout", file=sys.stdout if isinstance(exc, TimeoutError) else sys.stderr)
    print(exc, file=sys.stderr)
"""
LISTEN = """
import socket, sys
s = socket.create_server(("0.0.0.0", 5555))
print("ready", flush=True)
for _ in range(int(sys.argv[1])):
    s.accept()[0].close()
"""


def _round_trips(a: netns.Node, b: netns.Node, count: int) -> list[str]:
    """`count` connection times from a to b (by b's host name, through /etc/hosts)."""
    server = b.popen([sys.executable, "-c", LISTEN, str(count)])
    try:
        assert server.stdout.readline().strip() == "ready"
        return [a.run([sys.executable, "-c", CONNECT, b.name, "5555"], timeout=30).stdout.strip()
                for _ in range(count)]
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.mark.slow  # about 7.5 s on 2 cores: over the fast tier's 3 s a case
def test_nodes_have_their_own_names_and_reach_each_other_through_faults(cluster):
    c = cluster(3)
    n0, n1, n2 = c.nodes
    for node in c.nodes:
        out = node.run(["sh", "-c", "hostname; ip -4 -o addr show dev eth0; getent hosts node2"], timeout=30).stdout
        assert out.split()[0] == node.name and f"{node.address}/24" in out and "10.77.0.3" in out, out
    plain = _seconds_to_send(n0, n1)
    c.throttle(n1, 800)  # 400 KB at 800 kbit/s: 4 s (the bucket's 16 KB burst aside)
    slow = _seconds_to_send(n0, n1)
    assert 3.5 < slow < 8 and plain < 1, (plain, slow)
    c.heal(n1)
    c.cut(n2)
    assert _round_trips(n0, n2, 1) == ["timeout"]
    assert float(_round_trips(n0, n1, 1)[0]) < 200  # the others are not affected
    c.heal(n2)
    healed = [_round_trips(n0, n2, 1) for _ in range(3)]  # the first may meet a failed ARP entry
    assert healed[-1] not in (["timeout"], [""]), healed


def test_netem_delay_adds_its_latency(cluster):
    if (reason := netns.netem_missing()) is not None:
        pytest.skip(reason)
    c = cluster(2)
    plain = float(_round_trips(c.nodes[0], c.nodes[1], 1)[0])
    c.delay(c.nodes[1], 100)  # each way: a TCP connect (SYN, SYN-ACK) takes one round trip, >= 200 ms
    slow = float(_round_trips(c.nodes[0], c.nodes[1], 1)[0])
    assert slow >= 200 > plain, (plain, slow)


SINK = """
import socket
s = socket.create_server(("0.0.0.0", 5556))
print("ready", flush=True)
c = s.accept()[0]
while c.recv(65536):
    pass
"""
SEND = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5556), timeout=30)
t0 = time.perf_counter()
c.sendall(bytes(400_000))
c.shutdown(socket.SHUT_WR)
c.recv(1)
print(f"{time.perf_counter() - t0:.2f}")
"""


def _seconds_to_send(a: netns.Node, b: netns.Node) -> float:
    """Seconds for 400 KB from a to b, until b has read them all (it closes after the last byte)."""
    sink = b.popen([sys.executable, "-c", SINK])
    try:
        assert sink.stdout.readline().strip() == "ready"
        return float(a.run([sys.executable, "-c", SEND, b.name], timeout=60).stdout)
    finally:
        sink.kill()
        sink.wait(timeout=10)


def test_close_kills_what_runs_on_the_nodes_and_removes_everything(cluster):
    c = cluster(2)
    sleeper = c.nodes[1].popen(["sleep", "600"])
    deadline = time.monotonic() + 10  # the node's start-up runs `hostname` as a child before exec'ing sleep
    while c.pids(c.nodes[1]) != [sleeper.pid] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.pids(c.nodes[1]) == [sleeper.pid]
    names = [n.namespace for n in c.nodes] + [c.bridge]
    c.close()
    assert sleeper.wait(timeout=10) != 0
    assert not any(name in _listing() for name in names)
    assert not any((netns.NETNS_ETC / n).exists() for n in names)


def test_leftovers_of_a_crashed_run_are_removed_and_a_live_runs_are_kept(cluster):
    live = cluster(2)
    dead = subprocess.Popen(["true"])
    dead.wait()
    crashed = [f"g2f{dead.pid}c0n0", f"g2f{dead.pid}b0"]
    subprocess.run(["ip", "netns", "add", crashed[0]], check=True, timeout=30)
    subprocess.run(["ip", "link", "add", crashed[1], "type", "bridge"], check=True, timeout=30)
    (netns.NETNS_ETC / crashed[0]).mkdir(parents=True)
    try:
        assert sorted(netns.remove_leftovers()) == sorted(crashed)
        assert not any(name in _listing() for name in crashed) and not (netns.NETNS_ETC / crashed[0]).exists()
        assert all(node.namespace in _listing() for node in live.nodes)  # this process's: alive
    finally:
        subprocess.run(["ip", "netns", "del", crashed[0]], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", crashed[1]], capture_output=True, timeout=30)


def _listing() -> str:
    time.sleep(0.1)
    return (subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
            + subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout)
