"""The process's tensor-parallel group, set once when a rank starts."""
from __future__ import annotations

from replicas.distributed.communicator import Communicator, SingleCommunicator

_TP: Communicator = SingleCommunicator()


def set_tp_group(comm: Communicator) -> None:
    global _TP
    _TP = comm


def get_tp_group() -> Communicator:
    return _TP


def tp_rank() -> int:
    return _TP.rank


def tp_size() -> int:
    return _TP.world_size
