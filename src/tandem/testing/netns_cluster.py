"""A cluster of network hosts on one machine: each host a network namespace with its own
address, joined by a switch over bandwidth-limited links (a `tbf` qdisc on both ends of each
host's veth), so ranks placed on different hosts exchange bytes through a real network stack
at a real, limited rate.

    with NetnsCluster(2, rate_mbit=200) as cluster:
        procs = [cluster.popen(i, torchrun_argv(nnodes=2, node_rank=i,
                                                master_addr=cluster.hosts[0].address,
                                                master_port=29500, args=["tandem", "generate", "hi"]))
                 for i in range(2)]

Needs root and iproute2 (`namespaces_available()` says why not). Everything it makes carries a
unique prefix and lives inside namespaces it created (the switch included), so it never touches
an interface of the machine; `close()` (also at exit, on an exception in the `with` body and, for
the command line, on SIGTERM/SIGINT) kills every process it started or that runs in its
namespaces and deletes the namespaces, which removes their links and qdiscs with them.

Command line: run a command on every host, with NODE_RANK, MASTER_ADDR, HOST_ADDR and
GLOO_SOCKET_IFNAME set, and clean up:

    python benchmarks/netns_cluster.py --hosts 2 --rate-mbit 200 -- sh -c 'echo $NODE_RANK $HOST_ADDR'
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

_instances = itertools.count()
_open_clusters: "set[NetnsCluster]" = set()
_lock = threading.Lock()


@dataclass(frozen=True)
class Host:
    name: str  # the network namespace
    address: str  # its IPv4 address on the cluster's switch
    ifname: str  # its interface (inside its namespace), e.g. for GLOO_SOCKET_IFNAME


def namespaces_available() -> tuple[bool, str]:
    """Whether this process can make network namespaces, veth links and tbf qdiscs; the
    reason when it cannot."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (not running as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"tdprobe{os.getpid() % 100000}{uuid.uuid4().hex[:4]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip"] + (["-n", netns] if netns else []) + list(args)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def _tc(netns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", "netns", "exec", netns, "tc"] + list(args)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


class NetnsCluster:
    """`num_hosts` namespace hosts on one switch; every host's link shaped to `rate_mbit`
    in both directions (None: unshaped). `burst` and `latency_ms` are tbf's bucket size and
    longest queueing delay."""

    def __init__(
        self,
        num_hosts: int,
        *,
        rate_mbit: float | None = None,
        burst: str = "64kb",
        latency_ms: float = 100.0,
        prefix: str = "tdn",
    ) -> None:
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"num_hosts must lie in [1, 200], got {num_hosts}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0 (or None for an unshaped link), got {rate_mbit}")
        if not prefix.isalnum() or len(prefix) > 4:
            raise ValueError(f"prefix must be 1-4 letters or digits (interface names are short), got {prefix!r}")
        ok, reason = namespaces_available()
        if not ok:
            raise RuntimeError(f"cannot make a namespace cluster: {reason}")
        # Interface names hold at most 15 characters: prefix (4) + tag (6) + role/index (4).
        tag = f"{os.getpid() % 10000:04d}{next(_instances) % 100:02d}"
        self.token = f"{prefix}{tag}"
        self.burst, self.latency_ms, self.rate_mbit = burst, latency_ms, rate_mbit
        self.switch = f"{self.token}sw"
        subnet = 16 + (int(tag) % 200)
        self.hosts = [
            Host(name=f"{self.token}h{i}", address=f"10.{subnet}.{i // 250}.{i % 250 + 1}", ifname=f"{self.token}e{i}")
            for i in range(num_hosts)
        ]
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        with _lock:
            _open_clusters.add(self)
        try:
            self._build()
            self.set_rate(rate_mbit)
        except BaseException:
            self.close()
            raise

    # -- construction -------------------------------------------------------------------
    def _switch_port(self, index: int) -> str:
        return f"{self.token}p{index}"

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "set", "lo", "up", netns=self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for i, host in enumerate(self.hosts):
            _ip("netns", "add", host.name)
            _ip("link", "set", "lo", "up", netns=host.name)
            port = self._switch_port(i)
            _ip("link", "add", host.ifname, "netns", host.name, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("addr", "add", f"{host.address}/16", "dev", host.ifname, netns=host.name)
            _ip("link", "set", host.ifname, "up", netns=host.name)
            _ip("link", "set", port, "master", "br0", netns=self.switch)
            _ip("link", "set", port, "up", netns=self.switch)

    # -- shaping and faults -------------------------------------------------------------
    def _link_ends(self, index: int) -> list[tuple[str, str]]:
        host = self.hosts[index]
        return [(host.name, host.ifname), (self.switch, self._switch_port(index))]

    def set_rate(self, rate_mbit: float | None) -> None:
        """Shape every host's link to `rate_mbit` each way (None removes the shaping)."""
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0 (or None), got {rate_mbit}")
        for index in range(len(self.hosts)):
            for netns, dev in self._link_ends(index):
                if rate_mbit is None:
                    _tc(netns, "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    _tc(
                        netns, "qdisc", "replace", "dev", dev, "root", "tbf",
                        "rate", f"{rate_mbit:g}mbit", "burst", self.burst, "latency", f"{self.latency_ms:g}ms",
                    )
        self.rate_mbit = rate_mbit

    def qdisc(self, index: int) -> str:
        """`tc qdisc show` of host `index`'s interface (what shaping is in force)."""
        host = self.hosts[index]
        return _tc(host.name, "qdisc", "show", "dev", host.ifname).stdout

    def set_link_up(self, index: int, up: bool) -> None:
        """Cut (or restore) host `index`'s link, as a pulled cable would."""
        _ip("link", "set", self.hosts[index].ifname, "up" if up else "down", netns=self.hosts[index].name)

    # -- running commands ---------------------------------------------------------------
    def env(self, index: int, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on host `index`: the sockets of gloo (and NCCL/TP)
        bound to the host's interface, and the cluster's coordinates."""
        host = self.hosts[index]
        env = dict(os.environ if base is None else base)
        env.update(
            GLOO_SOCKET_IFNAME=host.ifname,
            NCCL_SOCKET_IFNAME=host.ifname,
            TP_SOCKET_IFNAME=host.ifname,
            NODE_RANK=str(index),
            NNODES=str(len(self.hosts)),
            MASTER_ADDR=self.hosts[0].address,
            HOST_ADDR=host.address,
        )
        return env

    def popen(self, index: int, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start `argv` on host `index` (in its own process group, killed by `close()`)."""
        if self._closed:
            raise RuntimeError("the cluster is closed")
        popen_kwargs.setdefault("env", self.env(index))
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[index].name, *argv], **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(self, index: int, argv: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` on host `index` to completion; on `timeout` it is killed and
        `subprocess.TimeoutExpired` raised."""
        kwargs.setdefault("text", True)
        proc = self.popen(index, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def run_on_all(
        self, argv_for_host: Callable[[int], list[str]], *, timeout: float, **kwargs
    ) -> list[subprocess.CompletedProcess]:
        """Start one command per host at once (e.g. torchrun nodes) and wait for all; on
        `timeout` every one is killed and `subprocess.TimeoutExpired` raised."""
        kwargs.setdefault("text", True)
        procs = [
            self.popen(i, argv_for_host(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
            for i in range(len(self.hosts))
        ]
        results: list[subprocess.CompletedProcess | None] = [None] * len(procs)

        def wait(i: int) -> None:
            out, err = procs[i].communicate()
            results[i] = subprocess.CompletedProcess(procs[i].args, procs[i].returncode, out, err)

        waiters = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(procs))]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            waiter.join(timeout)  # the shared deadline is checked below
        if any(r is None for r in results):
            for proc in procs:
                _kill_group(proc)
            for waiter in waiters:
                waiter.join(10)
            raise subprocess.TimeoutExpired(procs[0].args, timeout)
        return results  # type: ignore[return-value]

    # -- teardown -----------------------------------------------------------------------
    def namespaces(self) -> list[str]:
        return [self.switch] + [h.name for h in self.hosts]

    def close(self) -> None:
        """Kill every process started here or running inside the namespaces, then delete the
        namespaces (their veths, bridge and qdiscs go with them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            _kill_group(proc)
        existing = set(_ip("netns", "list", check=False).stdout.split())
        for name in self.namespaces():
            if name not in existing:
                continue
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in self.namespaces():
            if name in existing:
                _ip("netns", "del", name, check=False)
        with _lock:
            _open_clusters.discard(self)

    def __enter__(self) -> "NetnsCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NetnsCluster({len(self.hosts)} hosts, rate_mbit={self.rate_mbit}, token={self.token!r})"


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _close_all() -> None:
    for cluster in list(_open_clusters):
        cluster.close()


atexit.register(_close_all)


def torchrun_argv(
    *, nnodes: int, node_rank: int, master_addr: str, master_port: int, args: list[str], module: bool = True,
    nproc_per_node: int = 1,
) -> list[str]:
    """`torchrun` for one node of a static multi-node job: `args` is a module and its
    arguments (module=True, e.g. ["tandem", "serve", ...]) or a script and its arguments."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), "--node-rank", str(node_rank),
        "--master-addr", master_addr, "--master-port", str(master_port),
        *(["-m"] if module else []), *args,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=None, help="link rate each way (default: unshaped)")
    parser.add_argument("--burst", default="64kb")
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before every command is killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...: run on every host")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --")

    def stop(signum, frame):  # SIGTERM cleans up like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with NetnsCluster(args.hosts, rate_mbit=args.rate_mbit, burst=args.burst, latency_ms=args.latency_ms) as cluster:
        for host in cluster.hosts:
            print(f"{host.name}: {host.address} on {host.ifname}", file=sys.stderr)
        procs = [cluster.popen(i, command) for i in range(len(cluster.hosts))]
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=args.timeout))
            except subprocess.TimeoutExpired:
                print(f"timed out after {args.timeout:g} s; stopping every host", file=sys.stderr)
                return 124
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
