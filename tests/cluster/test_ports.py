"""The ports a cluster listens on are distinct: a port chosen twice would put HAProxy's statistics page
where clients expect duplexd (HAProxy binds both listeners to one port without a complaint)."""

from __future__ import annotations

from duplexd.cluster import Cluster
from duplexd.netutil import free_ports


def test_free_ports_are_distinct_and_free() -> None:
    import socket

    ports = free_ports(300)
    assert len(set(ports)) == 300
    with socket.socket() as s:  # and free: released once chosen
        s.bind(("127.0.0.1", ports[0]))


def test_a_clusters_balancer_statistics_and_workers_get_ports_of_their_own() -> None:
    for _ in range(50):
        cluster = Cluster(8)
        ports = [cluster.port, cluster.stats_port, *(w.port for w in cluster.workers)]
        assert len(set(ports)) == len(ports) == 10, ports
        cluster.stop()  # (nothing started: removes its run directory)


def test_ports_given_are_kept() -> None:
    cluster = Cluster(2, port=18000, stats_port=18404, base_port=18000)
    assert (cluster.port, cluster.stats_port, [w.port for w in cluster.workers]) == (18000, 18404, [18001, 18002])
    cluster.stop()
