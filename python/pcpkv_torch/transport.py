"""transport="auto" (SPEC section 5.1): `direct` when every PCP peer is reachable by peer stores (one host, and the
same device, CUDA P2P access or shared memory between every pair of ranks), `collect` over NCCL otherwise. The
decision is pcpkv::choose_transport (one C++ function, shared with the CLI's --transport auto)."""

from __future__ import annotations

import logging
import socket
from typing import Sequence

import torch

__all__ = ["TRANSPORTS", "choose_transport", "resolve_transport", "one_process_topology"]

TRANSPORTS = ("collect", "staging", "direct")

logger = logging.getLogger("pcpkv_torch")


def choose_transport(hosts: Sequence[str], peer_access, nccl_available: bool = False) -> tuple[str, str]:
    """The transport for a PCP group described by hosts (one name per rank, equal within a host), peer_access
    ([P, P] bools, row a column b: rank a can store into rank b's memory; a nested list or a bool tensor; the
    diagonal is not read) and nccl_available (True or False). Returns (transport, reason), reason a one-line why.
    Raises ValueError naming the field for a malformed topology, and when the peers are unreachable without NCCL.
    Taken as truth values before: nccl_available="no" (chose collect over NCCL), a float tensor's or a nested
    list's 0.4, nan or 1 (peer access); a generator of hosts was used up by the check and reported as 0 hosts."""
    if isinstance(hosts, str) or not isinstance(hosts, Sequence) or not all(isinstance(h, str) for h in hosts):
        raise ValueError(f"hosts = {hosts!r}: expected a sequence of host names (str), one per rank")
    if not isinstance(nccl_available, bool):
        raise ValueError(f"nccl_available = {nccl_available!r} must be True or False")
    access = peer_access
    if not isinstance(access, torch.Tensor):
        try:  # without dtype=bool: nested lists of 1 / 0.4 / nan were taken as truth values, as a float tensor was
            access = torch.tensor(access)
        except (TypeError, ValueError, RuntimeError) as e:  # None, strings, ragged lists
            raise ValueError(f"peer_access = {peer_access!r}: expected [P, P] bools (a bool tensor or nested lists "
                             f"of bools) ({e})") from None
        if access.numel() == 0:
            access = access.bool()  # [] is float: the shape check names it
    if access.dtype != torch.bool or access.device.type == "meta":
        raise ValueError(f"peer_access: expected a bool tensor (or nested lists of bools), got {access.dtype} on "
                         f"{access.device}")
    return tuple(torch.ops.pcpkv.choose_transport(list(hosts), access, nccl_available))


def one_process_topology(pcp_world: int) -> dict:
    """The topology of pcp_world logical ranks in one process on one device (PcpWorld): one host, and every
    replica plain memory of that device to every rank. ValueError naming pcp_world unless an integer >= 1."""
    if isinstance(pcp_world, bool) or not isinstance(pcp_world, int) or pcp_world < 1:
        raise ValueError(f"pcp_world = {pcp_world!r} must be an integer >= 1")
    return {"hosts": [socket.gethostname() or "localhost"] * pcp_world,
            "peer_access": torch.ones((pcp_world, pcp_world), dtype=torch.bool), "nccl_available": False}


def resolve_transport(transport: str, topology: dict) -> tuple[str, str]:
    """(transport, reason): transport itself for one of TRANSPORTS (reason ""), choose_transport(**topology) for
    "auto" (the reason logged on the "pcpkv_torch" logger at INFO). Raises ValueError for another name."""
    if transport in TRANSPORTS:
        return transport, ""
    if transport != "auto":
        raise ValueError(f"transport = {transport!r}; expected one of {TRANSPORTS} or 'auto'")
    keys = ("hosts", "peer_access", "nccl_available")
    if not isinstance(topology, dict) or not {"hosts", "peer_access"} <= set(topology) <= set(keys):
        raise ValueError(f"topology = {topology!r} must be a dict of hosts, peer_access and optionally "
                         "nccl_available (choose_transport's arguments; e.g. one_process_topology(W))")
    chosen, reason = choose_transport(**topology)
    logger.info("transport auto: %s", reason)
    return chosen, reason
