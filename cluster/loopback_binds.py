"""Serve's gRPC listeners on a loopback node: imported by every Python worker of `tidal serve`'s local cluster when
`--host` is loopback (RAY_preload_python_modules, cluster.local_cluster.keep_ray_on_loopback).

A Serve replica binds its internal gRPC server to "[::]:0", every interface, with no setting to change that
(ray/serve/_private/replica.py). Imported before any actor class is loaded, this module makes Ray's gRPC port
helper bind such wildcard addresses to the node's address when that is loopback; elsewhere nothing changes.
"""
from __future__ import annotations

import ipaddress

from ray._common import tls_utils

WILDCARDS = ("[::]", "0.0.0.0", "")

_add_port = tls_utils.add_port_to_grpc_server


def on_loopback_node(address: str, node_ip: str) -> str:
    """`address` ("host:port"), its wildcard host replaced by `node_ip` when that is a loopback address."""
    host, _, port = address.rpartition(":")
    ip = ipaddress.ip_address(node_ip)
    if host in WILDCARDS and ip.is_loopback:
        return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return address


def add_port_to_grpc_server(server, address):
    import ray

    return _add_port(server, on_loopback_node(address, ray.util.get_node_ip_address()))


tls_utils.add_port_to_grpc_server = add_port_to_grpc_server
