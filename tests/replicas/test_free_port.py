"""free_port: the ports local servers, TP rendezvous and HAProxy's listeners are told to bind later."""
import socket

from replicas.distributed.launch import _ephemeral_range, free_port


def test_ports_lie_below_the_kernels_ephemeral_range_are_distinct_and_bindable():
    low, _ = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < low for p in ports)
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
