"""A small cluster on this host: N "nodes", each a Linux network namespace with its own network
stack, address, host name, /etc/hosts and environment, joined by veth pairs to one bridge.

    node i: namespace g2f<pid>c<k>n<i>, interface eth0 = 10.77.0.<i+1>/24, host name node<i>
            (its own UTS namespace), /etc/hosts naming every node (`ip netns exec` binds
            /etc/netns/<namespace>/hosts over /etc/hosts inside it)
    bridge  g2f<pid>b<k> in the host's namespace, without an address: the nodes reach each other
            and nothing else (the host cannot reach them either; everything runs inside a node)

Every name carries the pid of the process that made it, so runs side by side do not collide, and a
run that crashed leaves names whose pid is dead: `remove_leftovers` deletes those (and only those)
before a new cluster is built. `Cluster.close` kills what runs inside the namespaces (by pid, from
`ip netns pids`) and deletes the namespaces, the bridge and the /etc/netns folders; the fixture in
conftest.py calls it in a finalizer, so a failing test cleans up too.

Faults: `cut` takes a node's link off the bridge (both ends stay up, nothing gets through: a
partition), `throttle` limits it with a token bucket (`tc tbf` on both ends, as qdiscs act on
egress only), `delay` adds latency with `tc netem` where the kernel has it (`netem_missing` says
why not: this machine's kernel lacks sch_netem), `heal` undoes them. `signal_node` sends a signal
to every process of a node, as a scheduler or a dying machine would.

Needs root (namespaces, veths, tc); `probe()` says why not when it cannot.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"
PREFIX = "g2f"
NETNS_ETC = Path("/etc/netns")
_LEFTOVER = re.compile(rf"{PREFIX}(\d+)[bc]")  # namespaces g2f<pid>c..., bridges g2f<pid>b...
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def probe() -> str | None:
    """Why a cluster cannot be built here (None when it can): not root, or `ip netns add` refused."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns, veth, tc netem)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    name = f"{PREFIX}{os.getpid()}cprobe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", name, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces, bridges and /etc/netns folders of runs whose process is gone
    (a crashed or killed test run); returns their names."""
    gone = []
    namespaces = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    bridges = [line.split(":")[1].strip().split("@")[0]
               for line in _ip("-o", "link", "show", "type", "bridge").stdout.splitlines()]
    folders = [p.name for p in NETNS_ETC.iterdir()] if NETNS_ETC.is_dir() else []
    for name in sorted(set(namespaces + bridges + folders)):
        m = _LEFTOVER.match(name)
        if not m or _alive(int(m[1])):
            continue
        if name in namespaces:
            _kill_all(name, signal.SIGKILL)
            _ip("netns", "del", name, check=False)
        if name in bridges:
            _ip("link", "del", name, check=False)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        gone.append(name)
    return gone


def _pids(namespace: str) -> list[int]:
    out = _ip("netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_all(namespace: str, signum: int) -> list[int]:
    pids = _pids(namespace)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    return pids


@dataclass
class Node:
    """One namespaced node: `index`, `name` (its host name), `address` on eth0, `namespace`, and
    `veth` (the host end of its link)."""

    index: int
    name: str
    address: str
    namespace: str
    veth: str
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside this node: its network namespace, /etc/hosts, and a UTS namespace with
        its host name (so `hostname` and socket.getfqdn() say node<i>, as on a real node)."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *argv]

    def popen(self, argv: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start `argv` on this node with the node's environment (updated with `env`); stdout and
        stderr together as text unless `kwargs` say otherwise. The caller bounds the wait."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        return subprocess.Popen(self.argv(argv), env={**self.env, **(env or {})}, text=True, **kwargs)

    def run(self, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)


class Cluster:
    """`n` nodes (2 to 4) on one bridge; `base_env` is every node's environment before its own
    HOSTNAME and GLOO_SOCKET_IFNAME. Use as a context manager or call `close()`."""

    def __init__(self, n: int, base_env: dict[str, str]):
        if not 2 <= n <= 4:
            raise ValueError(f"a cluster has 2 to 4 nodes, not {n}")
        k = next(_counter) % 36
        tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{tag}b{k:x}"
        self.nodes = [Node(i, f"node{i}", f"{SUBNET}.{i + 1}", f"{tag}c{k:x}n{i}", f"{tag}v{k:x}{i}")
                      for i in range(n)]
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), for close()
        try:
            self._build(base_env)
        except BaseException:
            self.close()
            raise

    def _build(self, base_env: dict[str, str]) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.name}\n" for n in self.nodes)
        for node in self.nodes:
            _ip("netns", "add", node.namespace)
            self._made.append(("netns", node.namespace))
            etc = NETNS_ETC / node.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "hostname").write_text(node.name + "\n")
            _ip("link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.namespace)
            _ip("link", "set", node.veth, "master", self.bridge, "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _ip("-n", node.namespace, "link", "set", "eth0", "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            node.env = {**base_env, "HOSTNAME": node.name, "GLOO_SOCKET_IFNAME": "eth0"}

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process inside the nodes, then delete the namespaces, bridge and folders."""
        for kind, name in self._made:
            if kind == "netns":
                _kill_all(name, signal.SIGKILL)
        for _ in range(50):  # the kernel reaps them within milliseconds; bounded anyway
            if not any(_pids(name) for kind, name in self._made if kind == "netns"):
                break
            time.sleep(0.1)
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
                shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()

    # --- faults ------------------------------------------------------------------------------------

    def cut(self, node: Node) -> None:
        """Nothing gets to or from `node` any more: its link leaves the bridge, while both ends stay
        up (no carrier loss, no reset, no error: a failed switch port or a partition; TCP peers
        retransmit until their timeouts)."""
        _ip("link", "set", node.veth, "nomaster")

    def heal(self, node: Node) -> None:
        """Undo `cut`, `throttle` and `delay` on `node`'s link."""
        _ip("link", "set", node.veth, "master", self.bridge)
        _tc("qdisc", "del", "dev", node.veth, "root", check=False)
        _tc("qdisc", "del", "dev", "eth0", "root", check=False, netns=node.namespace)

    def throttle(self, node: Node, kbit: int) -> None:
        """Limit `node`'s link to `kbit` kbit/s each way (a token bucket on both ends; transfers take
        longer, nothing is lost)."""
        spec = ("tbf", "rate", f"{kbit}kbit", "burst", "16kb", "latency", "10s")
        _tc("qdisc", "replace", "dev", node.veth, "root", *spec)
        _tc("qdisc", "replace", "dev", "eth0", "root", *spec, netns=node.namespace)

    def delay(self, node: Node, ms: int) -> None:
        """Add `ms` milliseconds each way to `node`'s link (`tc netem`: see `netem_missing`)."""
        _tc("qdisc", "replace", "dev", node.veth, "root", "netem", "delay", f"{ms}ms")
        _tc("qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{ms}ms", netns=node.namespace)

    def signal_node(self, node: Node, signum: int) -> list[int]:
        """Send `signum` to every process running on `node`; returns their pids."""
        return _kill_all(node.namespace, signum)

    def pids(self, node: Node) -> list[int]:
        return _pids(node.namespace)


def netem_missing() -> str | None:
    """Why `tc netem` cannot be used here (None when it can): kernels built without sch_netem
    (this development machine's among them) refuse the qdisc."""
    if os.geteuid() != 0:
        return "needs root"
    probe = f"{PREFIX}{os.getpid()}bnetem"[:15]  # a veth pair: this kernel has no dummy interfaces
    if _ip("link", "add", probe, "type", "veth", "peer", "name", probe[:-1] + "p", check=False).returncode:
        return "cannot create a veth pair to probe netem"
    try:
        made = _tc("qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms", check=False)
        return None if made.returncode == 0 else f"tc netem refused: {made.stderr.strip()}"
    finally:
        _ip("link", "del", probe, check=False)


def _tc(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.run([*prefix, "tc", *args], capture_output=True, text=True, timeout=30, check=check)
