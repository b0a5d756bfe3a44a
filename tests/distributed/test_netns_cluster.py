"""The one-machine cluster (benchmarks/netns_cluster.py): namespace hosts that reach each
other over shaped links, torchrun nodes across them, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tandem.testing.netns_cluster import NetnsCluster, namespaces_available, torchrun_argv  # noqa: E402

_ok, _reason = namespaces_available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_reason}")

ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(20)
    print("listening", flush=True)
    conn, peer = s.accept(); conn.sendall(b"from " + sys.argv[1].encode() + b" to " + peer[0].encode())
    """
)
ECHO_CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    for _ in range(100):
        try:
            c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2); break
        except OSError:
            time.sleep(0.1)
    print(c.recv(100).decode())
    """
)


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


@pytest.mark.slow
def test_hosts_reach_each_other_at_their_own_addresses():
    with NetnsCluster(2) as cluster:
        h0, h1 = cluster.hosts
        assert h0.address != h1.address and h0.name != h1.name
        server = cluster.popen(1, [sys.executable, "-c", ECHO_SERVER, h1.address, "5555"],
                               stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"
        reply = cluster.run(0, [sys.executable, "-c", ECHO_CLIENT, h1.address, "5555"], timeout=30)
        assert reply.returncode == 0, reply.stderr
        assert reply.stdout.strip() == f"from {h1.address} to {h0.address}"
        server.wait(timeout=10)


@pytest.mark.slow
def test_links_are_shaped_both_ways_and_can_be_reshaped():
    with NetnsCluster(2, rate_mbit=150, burst="32kb", latency_ms=50) as cluster:
        for i in range(2):
            assert "tbf" in cluster.qdisc(i) and "rate 150Mbit" in cluster.qdisc(i)
        switch_side = subprocess.run(["ip", "netns", "exec", cluster.switch, "tc", "qdisc", "show"],
                                     capture_output=True, text=True).stdout
        assert switch_side.count("rate 150Mbit") == 2  # the switch's end of each link
        cluster.set_rate(40)
        assert "rate 40Mbit" in cluster.qdisc(0) and "rate 40Mbit" in cluster.qdisc(1)
        cluster.set_rate(None)
        assert "tbf" not in cluster.qdisc(0)
        with pytest.raises(ValueError, match="rate_mbit"):
            cluster.set_rate(0)


@pytest.mark.slow
def test_a_cut_link_stops_traffic_and_a_restored_one_carries_it_again():
    with NetnsCluster(2) as cluster:
        probe = [sys.executable, "-c",
                 f"import socket; socket.create_connection(('{cluster.hosts[1].address}', 9), timeout=1)"]
        # The port is closed: a live link answers at once with a refusal, a cut one times out.
        assert "ConnectionRefusedError" in cluster.run(0, probe, timeout=20).stderr
        cluster.set_link_up(1, False)
        assert "timed out" in cluster.run(0, probe, timeout=20).stderr
        cluster.set_link_up(1, True)
        assert "ConnectionRefusedError" in cluster.run(0, probe, timeout=20).stderr


@pytest.mark.slow
def test_close_kills_processes_and_removes_namespaces_also_after_an_error():
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsCluster(2) as cluster:
            names = cluster.namespaces()
            assert set(names) <= _namespaces()
            sleeper = cluster.popen(1, ["sleep", "300"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None, "a process on a host outlived the cluster"
    assert not set(names) & _namespaces()
    assert _namespaces() == before
    cluster.close()  # idempotent


@pytest.mark.slow
def test_a_command_past_its_timeout_is_killed():
    with NetnsCluster(1) as cluster:
        with pytest.raises(subprocess.TimeoutExpired):
            cluster.run(0, ["sleep", "60"], timeout=1)
        assert all(p.poll() is not None for p in cluster._procs)


@pytest.mark.slow
def test_bad_arguments_are_refused_before_anything_is_made():
    before = _namespaces()
    with pytest.raises(ValueError, match="num_hosts"):
        NetnsCluster(0)
    with pytest.raises(ValueError, match="rate_mbit"):
        NetnsCluster(2, rate_mbit=-5)
    with pytest.raises(ValueError, match="prefix"):
        NetnsCluster(2, prefix="too-long-prefix")
    assert _namespaces() == before


@pytest.mark.slow
def test_gloo_all_reduce_across_two_torchrun_nodes(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(textwrap.dedent(
        """
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} at {os.environ['HOST_ADDR']}: {x.item():g}")
        dist.destroy_process_group()
        """
    ))
    with NetnsCluster(2, rate_mbit=100) as cluster:
        port = 29500  # the namespaces are the cluster's own: no port is taken there
        results = cluster.run_on_all(
            lambda i: torchrun_argv(nnodes=2, node_rank=i, master_addr=cluster.hosts[0].address,
                                    master_port=port, args=[str(script)], module=False),
            timeout=120,
        )
        for i, result in enumerate(results):
            assert result.returncode == 0, result.stderr[-2000:]
            assert f"rank {i} of 2 at {cluster.hosts[i].address}: 3" in result.stdout
