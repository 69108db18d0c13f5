"""The PCP batch plan (SPEC section 4) as tensors: pcpkv::make_plan through torch.ops.pcpkv.make_plan."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = ["Request", "PcpPlan", "make_plan", "LOCAL_ORDERS", "DECODE_OWNERSHIPS"]

# SPEC section 4.1. local_order: "request" (a rank's rows in request order) or "local" (vLLM's PCPManager: the
# segments that start at position 0, fresh prefills' head chunks, last; stable). decode_ownership: "replicated"
# (every rank holds every decode, rank 0 writes it) or "round_robin" (vLLM #52162: decode i of the batch's decodes
# is held, computed and written by rank i % pcp_world only).
LOCAL_ORDERS = ("request", "local")
DECODE_OWNERSHIPS = ("replicated", "round_robin")


@dataclass(frozen=True)
class Request:
    """One request of a batch: a prefill of num_new_tokens >= 1 or a decode (num_new_tokens == 1); the first
    new token has position context_len."""

    num_new_tokens: int
    context_len: int = 0
    decode: bool = False


@dataclass
class PcpPlan:
    """Per-rank local views (every [P, M] row padded to max_local_tokens M; padded rows have slot -1):
      positions [P, M] int64, slot_mapping [P, M] int64 (-1: padding or a decode copy another rank writes),
      global_index [P, M] int64 (-1 padding), num_local_tokens / num_prefill_tokens / num_decode_tokens [P],
      gathered_slot_mapping [P * M] (rank-major: row r*M + i of a staging buffer lands in this slot),
      global_positions / global_slots / global_request [N] (global token order), block_tables [R, max] int32
      padded with -1, num_blocks (cache blocks incl. the null block 0 when reserved), decode_owner [R] int64 (the
      rank that writes each decode, -1 for a prefill), local_order / decode_ownership (the modes it was built with)."""

    pcp_world: int
    block_size: int
    num_blocks: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    global_index: torch.Tensor
    num_local_tokens: torch.Tensor
    num_prefill_tokens: torch.Tensor
    num_decode_tokens: torch.Tensor
    gathered_slot_mapping: torch.Tensor
    global_positions: torch.Tensor
    global_slots: torch.Tensor
    global_request: torch.Tensor
    block_tables: torch.Tensor
    decode_owner: torch.Tensor
    local_order: str = "request"
    decode_ownership: str = "replicated"

    @property
    def max_local_tokens(self) -> int:
        return self.positions.shape[1]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def _check_types(pcp_world, requests, block_size, extra_blocks, seed, reserve_null_block, shuffle_blocks) -> list:
    """ValueError naming the argument for a value of the wrong type (pcp_world=True made a 1-rank plan, 2.0 or a
    request's 4.5 tokens raised the op's RuntimeError); the ranges are the C++ plan's to check."""
    for name, v in (("pcp_world", pcp_world), ("block_size", block_size), ("extra_blocks", extra_blocks),
                    ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"make_plan: {name} = {v!r} must be an integer")
    if not 0 <= seed < 2**64:  # pcpkv::PlanConfig::seed is a uint64 (the CLI's --seed range): -1 was 2^64 - 1
        raise ValueError(f"make_plan: seed = {seed!r} is out of range [0, {2**64 - 1}]")
    for name, v in (("reserve_null_block", reserve_null_block), ("shuffle_blocks", shuffle_blocks)):
        if not isinstance(v, bool):
            raise ValueError(f"make_plan: {name} = {v!r} must be True or False")
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise ValueError(f"make_plan: requests = {requests!r} must be a sequence of Request")
    requests = list(requests)
    for i, q in enumerate(requests):
        if not isinstance(q, Request):
            raise ValueError(f"make_plan: requests[{i}] = {q!r} must be a Request")
        for name in ("num_new_tokens", "context_len"):
            v = getattr(q, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"make_plan: requests[{i}].{name} = {v!r} must be an integer")
        if not isinstance(q.decode, bool):
            raise ValueError(f"make_plan: requests[{i}].decode = {q.decode!r} must be True or False")
    return requests


def _as_int64(seed: int) -> int:
    """The op's int64 argument carrying a uint64 seed (two's complement; the op casts it back to uint64)."""
    return seed - 2**64 if seed >= 2**63 else seed


def make_plan(pcp_world: int, requests: Sequence[Request], *, block_size: int = 64, extra_blocks: int = 0,
              reserve_null_block: bool = True, shuffle_blocks: bool = True, seed: int = 0,
              max_position_embeddings: int | None = None, local_order: str = "request",
              decode_ownership: str = "replicated") -> PcpPlan:
    """DualChunkSwap prefill split over pcp_world ranks, decodes replicated (only rank 0 writes) or owned
    round-robin, rows in request or vLLM's local order (LOCAL_ORDERS, DECODE_OWNERSHIPS; SPEC section 4.1), seeded
    block tables (pcpkv::make_plan). Tensors are on the CPU. Raises ValueError naming the field (pcp_world < 1,
    block_size not a power of two, an empty request, a decode with num_new_tokens != 1, an unknown local_order or
    decode_ownership, a value of the wrong type such as pcp_world=True or a request's 4.5 tokens, ...).

    max_position_embeddings: the model's (ModelSpec.max_position_embeddings, HF config); when given, a request
    whose positions reach it raises ValueError naming the request and the position (as pcpkv's publication
    refuses it: the model and its RoPE table cover positions [0, max_position_embeddings) only)."""
    requests = _check_types(pcp_world, requests, block_size, extra_blocks, seed, reserve_null_block, shuffle_blocks)
    if max_position_embeddings is not None and (
            isinstance(max_position_embeddings, bool) or not isinstance(max_position_embeddings, int)
            or max_position_embeddings < 1):
        raise ValueError(f"max_position_embeddings = {max_position_embeddings!r} must be an int >= 1")
    check_plan_modes(local_order, decode_ownership)
    r = torch.ops.pcpkv.make_plan(int(pcp_world), int(block_size), [int(q.decode) for q in requests],
                                  [int(q.num_new_tokens) for q in requests], [int(q.context_len) for q in requests],
                                  int(extra_blocks), reserve_null_block, shuffle_blocks, _as_int64(int(seed)), local_order,
                                  decode_ownership)
    positions, slots, gidx, counts, gathered, gpos, gslots, greq, tables, num_blocks, owner = r
    if max_position_embeddings is not None:
        _check_positions(requests, max_position_embeddings)
    return PcpPlan(pcp_world, block_size, int(num_blocks), positions, slots, gidx, counts[:, 0].clone(),
                   counts[:, 1].clone(), counts[:, 2].clone(), gathered, gpos, gslots, greq, tables, owner,
                   local_order, decode_ownership)


def check_plan_modes(local_order, decode_ownership) -> None:
    """Raises ValueError naming the argument for a local_order not in LOCAL_ORDERS or a decode_ownership not in
    DECODE_OWNERSHIPS."""
    if not isinstance(local_order, str) or local_order not in LOCAL_ORDERS:
        raise ValueError(f"local_order = {local_order!r}; expected one of {LOCAL_ORDERS}")
    if not isinstance(decode_ownership, str) or decode_ownership not in DECODE_OWNERSHIPS:
        raise ValueError(f"decode_ownership = {decode_ownership!r}; expected one of {DECODE_OWNERSHIPS}")


def _check_positions(requests: Sequence[Request], max_positions: int) -> None:
    # After the op: the requests are valid, so a request's last position is context_len + num_new_tokens - 1.
    for i, q in enumerate(requests):
        last = q.context_len + q.num_new_tokens - 1
        if last >= max_positions:
            what = (f"decode at position {q.context_len}" if q.decode
                    else f"prefill of {q.num_new_tokens} tokens from position {q.context_len}")
            first = max(q.context_len, max_positions)
            raise ValueError(f"requests[{i}] ({what}) reaches position {first}, but max_position_embeddings is "
                             f"{max_positions} (positions must be < {max_positions})")
