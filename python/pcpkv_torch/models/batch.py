"""One forward step's PCP batch over persistent paged block tables (SPEC section 4).

pcpkv_torch.make_plan splits the step (DualChunkSwap prefill; decodes replicated with rank 0 writing them, or owned
round-robin; rows in request or vLLM's local order, SPEC section 4.1) and gives each rank its local rows; the
slots come from block tables that live as long as their request, as an engine's
block manager keeps them, so a chunked prefill's new tokens and later decodes land beside the cached context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..layout import check_block_size
from ..plan import Request, check_plan_modes, make_plan

__all__ = ["BlockTables", "StepRequest", "StepBatch"]


class BlockTables:
    """Paged block tables of every live request: num_blocks blocks of block_size slots; block 0 is the null
    block (never handed out); blocks are handed out in a seeded random order (non-contiguous tables).
    Raises ValueError when a request needs more blocks than are free."""

    def __init__(self, num_blocks: int, block_size: int, *, seed: int = 0):
        check_block_size(block_size)  # the CLI's --block-size rule: 1 and 2 were refused later, unnamed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise ValueError(f"seed = {seed!r} must be an int in [0, 2^64)")
        # an int: 2.5 was a TypeError from torch.randperm (issue 31's break test)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks = {num_blocks!r} must be an int >= 2 (block 0 is the null block)")
        self.num_blocks, self.block_size = num_blocks, block_size
        gen = torch.Generator().manual_seed(seed)
        self._free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.tables: dict = {}
        self.lengths: dict = {}   # request_id -> tokens cached (positions [0, n) written by earlier steps)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def reserve(self, request_id, num_tokens: int):
        """Grows request_id's table to hold positions [0, num_tokens)."""
        table = self.tables.setdefault(request_id, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self._free):
            raise ValueError(f"request {request_id!r}: {num_tokens} tokens need {need} more blocks, "
                             f"{len(self._free)} free of num_blocks = {self.num_blocks}")
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        self.lengths[request_id] = max(self.lengths.get(request_id, 0), num_tokens)

    def snapshot(self):
        """The free list, tables and cached lengths as they are now (restore() puts them back exactly: a step that
        fails part-way leaves the blocks, their order and every request's cached tokens as before it)."""
        return list(self._free), {r: list(t) for r, t in self.tables.items()}, dict(self.lengths)

    def restore(self, snap):
        free, tables, lengths = snap
        self._free, self.tables, self.lengths = list(free), {r: list(t) for r, t in tables.items()}, dict(lengths)

    def release(self, request_id):
        """Returns a finished request's blocks to the free list (their cache bytes stay until overwritten)."""
        self._free.extend(reversed(self.tables.pop(request_id, [])))
        self.lengths.pop(request_id, None)

    def position_of_slot(self) -> torch.Tensor:
        """int64 [num_slots]: the position a slot holds in its request, -1 for slots no request reserved."""
        out = torch.full((self.num_slots,), -1, dtype=torch.int64)
        for r, n in self.lengths.items():
            pos = torch.arange(n, dtype=torch.int64)
            out[self.slots(r, pos)] = pos
        return out

    def slots(self, request_id, positions: torch.Tensor) -> torch.Tensor:
        """int64 slots of positions (int64 tensor) of a request: table[pos // B] * B + pos % B."""
        table = torch.tensor(self.tables[request_id], dtype=torch.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def table_tensor(self, request_ids: Sequence) -> torch.Tensor:
        """int32 [R, max_blocks] block tables of the requests in this order, padded with -1."""
        width = max(1, max(len(self.tables[r]) for r in request_ids))
        out = torch.full((len(request_ids), width), -1, dtype=torch.int32)
        for i, r in enumerate(request_ids):
            t = self.tables[r]
            out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return out


@dataclass(frozen=True)
class StepRequest:
    """One request of a step: `token_ids` (integer [n], n >= 1) are new tokens whose first has position
    context_len, which must equal the tokens of this request already cached (0 for a new request).
    decode: a 1-token decode (replicated on every rank with rank 0 writing it, or held by its round-robin owner:
    StepBatch's decode_ownership)."""

    request_id: object
    token_ids: torch.Tensor
    context_len: int = 0
    decode: bool = False


class StepBatch:
    """The PCP plan of one step over W ranks, global order = the requests in order, each request's tokens
    contiguous. Per rank r (M = max_local_tokens rows, padding rows at the end of a rank's list):
      global_index[r]  int64 [M]  global token of local row i, -1 padding
      positions[r]     int64 [M]  position (0 for padding)
      slot_mapping[r]  int64 [M]  slot written by this rank, -1 padding or a decode copy another rank writes
      request_idx[r]   int32 [M]  row of block_tables, -1 padding
      owner[r]         bool [M]   rows whose output this rank returns (each global token exactly once)
    gathered_slot_mapping int64 [W * M] (rank-major, the all-gather / staging order); block_tables int32 [R, S];
    input_ids / global_positions int64 [N]; global_slots int64 [N].
    local_order / decode_ownership: the plan modes (pcpkv_torch.LOCAL_ORDERS, DECODE_OWNERSHIPS); ValueError for
    another value. max_positions (optional): positions must stay below it (the RoPE table / the model's
    max_position_embeddings); a request past it is refused (ValueError naming max_positions_name) before a block is
    reserved. Everything is validated before `blocks` changes: a refused step leaves it as it was."""

    def __init__(self, pcp_world: int, requests: Sequence[StepRequest], blocks: BlockTables, device=None, *,
                 local_order: str = "request", decode_ownership: str = "replicated",
                 max_positions: Optional[int] = None, max_positions_name: str = "max_positions"):
        check_plan_modes(local_order, decode_ownership)
        if not requests:
            raise ValueError("requests: a step needs at least one request")
        ids = [q.request_id for q in requests]
        for i, rid in enumerate(ids):  # the block tables are keyed by it: a list id was set()'s TypeError
            try:
                hash(rid)
            except TypeError:
                raise ValueError(f"requests[{i}].request_id = {rid!r} must be hashable (a str or an int)") from None
        if len(set(ids)) != len(ids):
            raise ValueError(f"requests: a request_id appears twice in one step ({ids})")
        need = 0
        for i, q in enumerate(requests):
            t = q.token_ids
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() < 1 or t.dtype.is_floating_point or \
                    t.dtype == torch.bool:
                raise ValueError(f"requests[{i}] ({q.request_id!r}).token_ids: expected a non-empty 1-D integer "
                                 f"tensor, got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__} "
                                 f"{list(t.shape) if isinstance(t, torch.Tensor) else ''}")
            if q.decode and t.numel() != 1:
                raise ValueError(f"requests[{i}] ({q.request_id!r}): a decode has 1 token, got {t.numel()}")
            cached = blocks.lengths.get(q.request_id, 0)
            if q.context_len != cached:  # attending to positions that were never written would read stale bytes
                raise ValueError(f"requests[{i}] ({q.request_id!r}): context_len = {q.context_len}, but {cached} "
                                 "tokens of this request are cached")
            have = len(blocks.tables.get(q.request_id, []))
            need += max(0, -(-(q.context_len + t.numel()) // blocks.block_size) - have)
        if need > blocks.num_free:
            raise ValueError(f"requests: the step needs {need} more cache blocks, {blocks.num_free} are free "
                             f"(num_blocks = {blocks.num_blocks})")
        for i, q in enumerate(requests if max_positions is not None else ()):  # the RoPE table / the model end there
            end = q.context_len + q.token_ids.numel()
            if end > max_positions:
                raise ValueError(f"requests[{i}] ({q.request_id!r}): positions [{q.context_len}, {end}) reach past "
                                 f"{max_positions_name} = {max_positions} (positions must be < {max_positions})")
        # The plan first: a step it refuses (pcp_world = 0) reserved the blocks and marked the tokens cached, so the
        # same request's next step was refused ("context_len = 0, but 3 tokens of this request are cached").
        plan = make_plan(pcp_world, [Request(int(q.token_ids.numel()), q.context_len, q.decode) for q in requests],
                         block_size=blocks.block_size, shuffle_blocks=False, local_order=local_order,
                         decode_ownership=decode_ownership)
        for q in requests:
            blocks.reserve(q.request_id, q.context_len + int(q.token_ids.numel()))
        self.pcp_world, self.block_size = pcp_world, blocks.block_size
        self.num_slots = blocks.num_slots
        self.requests = list(requests)
        self.input_ids = torch.cat([q.token_ids.to(torch.int64).reshape(-1) for q in requests])
        self.global_positions = plan.global_positions.clone()
        greq = plan.global_request.to(torch.int64)
        gslots = torch.empty_like(self.global_positions)
        for i, q in enumerate(requests):
            sel = greq == i
            gslots[sel] = blocks.slots(q.request_id, self.global_positions[sel])
        self.global_slots = gslots
        gidx = plan.global_index
        real = gidx >= 0
        safe = gidx.clamp(min=0)
        self.global_index = gidx
        self.positions = plan.positions
        self.slot_mapping = torch.where(plan.slot_mapping >= 0, gslots[safe], torch.full_like(gidx, -1))
        self.request_idx = torch.where(real, greq[safe], torch.full_like(gidx, -1)).to(torch.int32)
        self.owner = self.slot_mapping >= 0
        self.gathered_slot_mapping = self.slot_mapping.reshape(-1).clone()
        self.block_tables = blocks.table_tensor(ids)
        self.max_local_tokens = int(gidx.shape[1])
        self.num_tokens = int(self.input_ids.numel())
        self.max_position = int(self.global_positions.max())
        if device is not None:
            self.to(device)

    def to(self, device):
        for k in ("global_index", "positions", "slot_mapping", "request_idx", "owner", "gathered_slot_mapping",
                  "block_tables"):
            setattr(self, k, getattr(self, k).to(device))
        return self

    def local_rows(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rows of global-order x [N, ...] that rank `rank` holds, [M, ...]; padding rows are zeros."""
        gidx = self.global_index[rank]
        rows = x.index_select(0, gidx.clamp(min=0))
        return rows * (gidx >= 0).view(-1, *([1] * (x.dim() - 1))).to(rows.dtype)

    def scatter_owned(self, out: torch.Tensor, local: torch.Tensor, rank: int):
        """out[global_index] = local for the rows rank owns (out: global order [N, ...])."""
        own = self.owner[rank]
        out.index_copy_(0, self.global_index[rank][own], local[own])
