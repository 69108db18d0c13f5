"""A vLLM-shaped publication entry point: VllmPcpPublisher (issue 35, item 2).

vLLM's DeepSeek-V3.2 attention publishes a PCP step's KV rows by `collect` today: fused_norm_rope without caches
(kv_c_out / k_pe_out / index_k_out materialized in bf16), then maybe_gather_mla_latent_cache_inputs (an all-gather
of the prefill rows over the PCP group) + impl.do_kv_cache_update, and in the indexer maybe_gather_indexer_k +
indexer_k_quant_and_cache. VllmPcpPublisher replaces those calls with one call per layer that takes what the
attention has at that point and publishes through `direct` (each rank stores final cache bytes into every
rank's replica, one fence), `staging` or `collect`, chosen by name or by `auto` (transport.choose_transport).
It works over the caches vLLM allocated (pcpkv_torch.EngineCaches maps every peer's cache once):

    pub = VllmPcpPublisher(kv_caches, indexer_k_caches, kv_cache_dtype="fp8_ds_mla", max_num_tokens=M,
                           group=get_pcp_group().device_group, transport="auto")                 # model init
    q_c = pub.publish(layer_idx, positions, q_c, ..., topk_indices_buffer, slot_mapping=layer_slot_mapping,
                      num_decode_tokens=attn_metadata.num_decode_tokens)                        # per layer
    pub.close()                                                                                 # teardown

What vLLM passes, read at these pinned commits of vllm-project/vllm (facts only; the code here is pcpkv's own):
  * vllm/models/deepseek_v32/attention.py @ 00859a52088e757514a25dddd0214ccc89898a1c: DeepseekV32Attention.forward
    calls fused_norm_rope(positions, q_c, q_a_layernorm.weight, q_a_layernorm.variance_epsilon, kv_c,
    kv_a_layernorm.weight, kv_a_layernorm.variance_epsilon, k_pe, rotary_emb.cos_sin_cache, index_k,
    indexer.k_norm.weight, indexer.k_norm.bias, indexer.k_norm.eps, indexer_rope_emb.cos_sin_cache,
    topk_indices_buffer, ...); q_c, kv_c, k_pe are splits of fused_qkv_a_proj's output [T, q_lora_rank | 512 | 64]
    (row stride q_lora_rank + 576), index_k the first 128 columns of indexer.wk_weights_proj's output; on the
    collect path (use_pcp without direct KV) no cache is passed, kv_c_out / k_pe_out / index_k_out are allocated,
    and _sparse_indexer_and_attn then runs sparse_attn_indexer(..., use_pcp=True) and
    maybe_gather_mla_latent_cache_inputs(kv_c, k_pe.unsqueeze(1), layer_slot_mapping,
    attn_metadata.num_decode_tokens, True) + impl.do_kv_cache_update(..., kv_cache_dtype, _k_scale). The MLA rope is
    interleaved (is_neox_style=False); the indexer's is NeoX unless config.indexer_rope_interleave.
  * vllm/v1/attention/ops/pcp.py @ 1b9992732904db92debef017b2c2628ac2cdd8b2: _gather_prefill_cache_inputs: the
    layer's slot mapping is the gathered one, rank-major: its first pcp_size * local_num_tokens entries viewed
    [pcp_size, local_num_tokens] are each rank's local tokens' slots; the first num_decode_tokens local tokens are
    decodes, replicated on every rank; the cache writes use rank 0's decode slots and every rank's prefill rows
    (torch.cat((rank_slot_mappings[0, :num_decode_tokens], rank_slot_mappings[:, num_decode_tokens:].flatten()))).
    maybe_gather_indexer_k uses the same function for index_k.
  * vllm/v1/worker/cp_utils.py @ 01eb4b46e2d87d4c3e969ef96d4089fcc95a2f2c: PCPManager.compute_rank_indices: each
    prefill's scheduled tokens are padded to a multiple of 2 * pcp_size and split DualChunkSwap (rank r holds
    chunks r and 2 * pcp_size - 1 - r); decodes (num_scheduled_tokens <= reorder_batch_threshold) come first and
    are duplicated on every rank; pad_slot_mapping puts -1 at padding tokens and at the copies of a decode other
    than the first, so in the rank-major gathered form a decode's copies on ranks > 0 hold -1.
  * vllm/models/deepseek_v32/common/kernels.py @ c73a65140a2101ea93979278cd326ee77d0b7bfb: fused_norm_rope's
    argument names and the cache layouts (pcpkv_torch.vllm, the drop-in, pins the same file).

Slot conventions taken here: slot_mapping int64 [>= W * T] (vLLM may hand a longer buffer: its first W * T entries
are used), rank-major, -1 = no row (padding, CUDA-graph padding). The decode copies of ranks > 0 are never
written, whatever they hold (as vLLM's cache slot mapping drops them), so -1 or rank 0's slot both work.
indexer_slot_mapping (keyword, optional, the same form): the indexer rows' own slots, for an indexer cache that
vLLM's hybrid allocator gave its own block table (docs/spec.md 4.2; its own num_blocks, the MLA cache's block_size);
None: slot_mapping addresses both caches.
"""

from __future__ import annotations

import hashlib
import logging
from operator import attrgetter, is_
import socket
import weakref
from typing import Optional, Sequence

import torch

from .engine_caches import EngineCaches
from .layout import allocate_staging
from .model_spec import CacheFormat, scale_problem
from .ops import combine, dispatch, fence, insert
from .rank_agreement import share_verdicts_and_agree_on, torch_gather
from .transport import TRANSPORTS, choose_transport

__all__ = ["VllmPcpPublisher", "VLLM_SOURCES"]

logger = logging.getLogger("pcpkv_torch")

_WHERE = "VllmPcpPublisher"

#: The vLLM files and commits this entry point follows (see the module docstring).
VLLM_SOURCES = (
    ("vllm/models/deepseek_v32/attention.py", "00859a52088e757514a25dddd0214ccc89898a1c"),
    ("vllm/v1/attention/ops/pcp.py", "1b9992732904db92debef017b2c2628ac2cdd8b2"),
    ("vllm/v1/worker/cp_utils.py", "01eb4b46e2d87d4c3e969ef96d4089fcc95a2f2c"),
    ("vllm/models/deepseek_v32/common/kernels.py", "c73a65140a2101ea93979278cd326ee77d0b7bfb"),
)

#: The ops' C++ entries (the OpOverloads' Python frames skipped): publish() passes them what the wrappers of ops.py
#: would, and what those wrappers check holds by construction (a CacheFormat, the fill mode "full", float32
#: weights, staging rows within the workspace). While torch.compile traces, the OpOverloads (traceable) instead.
_OPS = tuple(getattr(torch.ops.pcpkv, n).default._op for n in ("dispatch", "fence", "combine", "insert"))
_TRACED = tuple(getattr(torch.ops.pcpkv, n).default for n in ("dispatch", "fence", "combine", "insert"))


class _Layer:
    """What a layer's call checked and converted once for its weights and tables (held: q_rms_norm_w,
    kv_rms_norm_w, k_rope_cos_sin_cache, and on a layer with an indexer its LayerNorm weight, bias and table), for
    its later calls with the same tensors at the same stamp: q_lora_rank, the float32 weights and table. The memo
    keeps its tensors alive, so an identity test cannot be fooled by a freed tensor's id or address reused by
    another; _stamp sees what can change in a live tensor (set when the memo is stored, not while tracing)."""

    __slots__ = ("held", "stamp", "q_lora", "kv_w", "q_w", "ln_w", "ln_b", "rope")

    def __init__(self, held, q_lora, kv_w, q_w, ln_w, ln_b, rope):
        self.held, self.stamp, self.q_lora = held, None, q_lora
        self.kv_w, self.q_w, self.ln_w, self.ln_b, self.rope = kv_w, q_w, ln_w, ln_b, rope


def _stamp(ts) -> list:
    """What can change in a live held tensor that its checks and float32 copy read: the version counter (in-place
    writes, resize_, set_, as_strided_), data_ptr and dtype (`t.data = x` changes them with no version bump).
    data_ptr stands for the device too (host and CUDA addresses share one virtual address space). Not stamped, for
    the per-call cost: the shape of a `t.data = t.view(...)` at the same address and dtype (the same bytes, so the
    same float32 values; a new tensor of another shape is another object and is checked). An inference-mode tensor
    has no version counter (-1 here): its in-place writes are not seen (its values taken as fixed, as weights)."""
    return [(_version(t), t.data_ptr(), t.dtype) for t in ts]


class _Ops:
    """One layer's op arguments that only the publisher's configuration sets (made once, at init): the format's
    fields, the replicas' cache table (direct) or the staging destinations (per buffer), the fence's arguments."""

    __slots__ = ("fmt", "dispatch_to", "written", "fence", "combine_src", "mla", "index")


#: Argument names for _check_call's messages.
_EPS = ("q_rms_eps", "kv_rms_eps", "index_k_layer_norm_eps")
_INDEXER = ("index_k", "index_k_layer_norm_w", "index_k_layer_norm_bias", "index_k_rope_cos_sin_cache",
            "topk_indices_buffer")
_ON_DEVICE = ("positions", "q_c", "kv_c", "k_pe", "index_k", "q_rms_norm_w", "kv_rms_norm_w", "index_k_layer_norm_w",
              "index_k_layer_norm_bias", "topk_indices_buffer", "slot_mapping", "q_c_out", "indexer_slot_mapping")
_PER_CALL_ON_DEVICE = tuple(n for n in _ON_DEVICE if not n.endswith(("_w", "_bias")))


def _desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return f"{type(t).__name__} {t!r}"[:80]
    return f"{t.dtype} {list(t.shape)} on {t.device}"


def _version(t: torch.Tensor) -> int:
    """t's version counter; -1 for an inference-mode tensor, which has none (converted once: a weight or table
    changed in place under inference mode is not seen)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class VllmPcpPublisher:
    """Publication of each layer's KV rows of a PCP step into every rank's replica of vLLM's caches.

    Made once per model, collectively over `group` (the PCP group: every rank calls with its own caches):
      kv_caches         [L] this rank's MLA cache per attention layer as vLLM allocated it: [num_blocks,
                        block_size, 656] uint8 / float8_e4m3fn for "fp8_ds_mla", [.., 576] for "fp8" /
                        "fp8_e4m3", bf16 [.., 576] for "auto" (pcpkv_torch.vllm.KV_CACHE_DTYPES; padded block
                        strides are fine)
      indexer_k_caches  [L] the layer's indexer cache uint8 [num_blocks, block_size, 132], None on a layer without
                        an indexer (skip_topk layers); or None for a model without indexers
      kv_cache_dtype    vLLM's cache dtype string (above); ds_mla_scale "raw" (vLLM's rule) or "pow2"
      mla_k_scale       "fp8" only: the static scale as a float (float(layer._k_scale), read once by the engine)
      max_num_tokens    the most local tokens T of one step (the staging workspace's rows per rank)
      transport         "direct" | "staging" | "collect" | "auto" (choose_transport over the group's topology:
                        direct on one host with peer access between every pair, else collect)
      check             True: every publish() first shares each rank's verdict on its arguments and a digest of
                        what the ranks must agree on (layer, T, num_decode_tokens, the gathered slot mapping, the
                        eps and rope style), so a bad argument or a disagreement is a ValueError on every rank
                        before anything is written; on CUDA it also waits for the fence and raises its timeout.
                        One object all-gather per layer and a host sync: for bring-up and tests. False: nothing
                        per call but the publication (required under CUDA-graph capture).
    The caches of every layer must be on one device (cpu: in shared memory, tensor.share_memory_(); cuda: PyTorch's
    caching allocator) with the same layout on every rank; EngineCaches checks that and refuses on every rank.

    Attributes: transport, transport_reason, rank, world, fmts (CacheFormat per layer), caches (the EngineCaches,
    None for collect). Raises ValueError (every rank) for a bad argument or layouts that differ, RuntimeError
    (every rank) when the environment refuses (see EngineCaches). close() releases every peer mapping."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], indexer_k_caches: Optional[Sequence[Optional[torch.Tensor]]],
                 *, kv_cache_dtype: str = "fp8_ds_mla", max_num_tokens: int, transport: str = "auto",
                 ds_mla_scale: str = "raw", mla_k_scale: float = 1.0, group=None, check: bool = True,
                 timeout_s: float = 60.0, fence_timeout_s: float = 30.0):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{_WHERE}: torch.distributed is not initialized (the PCP group must exist)")
        self._group, self._closed, self.caches = group, False, None
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._gather = torch_gather(group, f"{_WHERE} (rank {self.rank})")
        why, fields = "", []
        try:
            fields = self._arguments(kv_caches, indexer_k_caches, kv_cache_dtype, max_num_tokens, transport,
                                     ds_mla_scale, mla_k_scale, check, fence_timeout_s)
        except ValueError as e:
            why = str(e)
        # a bad argument anywhere: ValueError everywhere; then one layout on every rank
        share_verdicts_and_agree_on(self._gather, f"{_WHERE} setup", why, lambda: fields)
        self.transport, self.transport_reason = self._resolve(transport)
        logger.info("%s: transport %s%s", _WHERE, self.transport,
                    f" ({self.transport_reason})" if self.transport_reason else "")
        self._tables: dict = {}   # memo: cos/sin tables and weights as float32, the index table's agreement
        self._staging_calls = 0   # staging publications so far: the buffer of the next one is its parity
        self._layers: dict = {}   # layer -> _Layer: its weights and tables as checked and converted (publish)
        if self.transport in ("direct", "staging"):
            staging = None
            if self.transport == "staging":
                staging = []
                for rb in sorted({f.row_bytes for f in self.fmts}):
                    s = allocate_staging(self.world, self.max_num_tokens,
                                         next(f for f in self.fmts if f.row_bytes == rb), self.device, fill=0)
                    staging.append(s.share_memory_() if self.device.type == "cpu" else s)
            self.caches = EngineCaches(self._mla, self._index, self.fmts, staging=staging, group=group,
                                       timeout_s=timeout_s)
        self._ops = [self._layer_ops(i) for i in range(len(self.fmts))]

    # ---- setup ------------------------------------------------------------------------------------------------

    def _arguments(self, kv_caches, indexer_k_caches, kv_cache_dtype, max_num_tokens, transport, ds_mla_scale,
                   mla_k_scale, check, fence_timeout_s) -> list:
        """This rank's argument checks (ValueError naming the argument); returns the fields the ranks must share."""
        from .vllm import KV_CACHE_DTYPES  # the drop-in's table (here, not at the top: vllm.py imports this module)

        if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype = {kv_cache_dtype!r}; expected one of {sorted(KV_CACHE_DTYPES)}")
        kv_format, dtypes, last = KV_CACHE_DTYPES[kv_cache_dtype]
        if transport not in TRANSPORTS + ("auto",):
            raise ValueError(f"transport = {transport!r}; expected one of {TRANSPORTS + ('auto',)}")
        if ds_mla_scale not in ("raw", "pow2"):
            raise ValueError(f"ds_mla_scale = {ds_mla_scale!r}; expected 'raw' (vLLM's rule) or 'pow2'")
        if not _is_int(max_num_tokens) or max_num_tokens < 1:
            raise ValueError(f"max_num_tokens = {max_num_tokens!r} must be an integer >= 1")
        if not isinstance(check, bool):
            raise ValueError(f"check = {check!r} must be True or False")
        if isinstance(fence_timeout_s, bool) or not isinstance(fence_timeout_s, (int, float)) or \
                not 1e-6 <= fence_timeout_s <= 86400.0:
            raise ValueError(f"fence_timeout_s = {fence_timeout_s!r} must be a number of seconds in [1e-06, 86400]")
        if isinstance(mla_k_scale, bool) or not isinstance(mla_k_scale, (int, float)):
            raise ValueError(f"mla_k_scale = {mla_k_scale!r} must be a float (read the engine's scale tensor once)")
        if kv_format == "fp8" and (why := scale_problem(float(mla_k_scale))):
            raise ValueError(f"mla_k_scale = {mla_k_scale!r} {why}")
        if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence) or not kv_caches:
            raise ValueError(f"kv_caches must be a non-empty list of per-layer MLA caches, got {_desc(kv_caches)}")
        L = len(kv_caches)
        if indexer_k_caches is None:
            indexer_k_caches = [None] * L
        if isinstance(indexer_k_caches, torch.Tensor) or not isinstance(indexer_k_caches, Sequence) or \
                len(indexer_k_caches) != L:
            raise ValueError(f"indexer_k_caches must be None or a list of {L} (one per layer of kv_caches, None where "
                             f"a layer has no indexer), got {_desc(indexer_k_caches)}")
        device = kv_caches[0].device if isinstance(kv_caches[0], torch.Tensor) else None
        mla, index, fmts, layout = [], [], [], []
        for i, (c, x) in enumerate(zip(kv_caches, indexer_k_caches)):
            if not isinstance(c, torch.Tensor) or c.dim() != 3 or c.dtype not in dtypes or c.shape[2] != last or \
                    c.stride(2) != 1:
                raise ValueError(f"kv_caches[{i}]: expected {' or '.join(str(d) for d in dtypes)} [num_blocks, "
                                 f"block_size, {last}] with unit inner stride for kv_cache_dtype {kv_cache_dtype!r}, "
                                 f"got {_desc(c)}")
            if x is not None and (not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype != torch.uint8 or
                                  x.shape[2] != 132):
                raise ValueError(f"indexer_k_caches[{i}]: expected uint8 [num_blocks, block_size, 132] or None, "
                                 f"got {_desc(x)}")
            for name, t in ((f"kv_caches[{i}]", c), (f"indexer_k_caches[{i}]", x)):
                if t is not None and t.device != device:
                    raise ValueError(f"{name} is on {t.device}, kv_caches[0] on {device}: one device per rank")
            mla.append(c.view(torch.uint8))  # pcpkv's tables address bytes: bf16 [.., 576] is uint8 [.., 1152]
            index.append(x)
            fmts.append(CacheFormat(kv_format, ds_mla_scale, float(mla_k_scale) if kv_format == "fp8" else 1.0,
                                    has_indexer=x is not None))
            layout.append([list(c.shape), x is not None])
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"kv_caches[0] is on {device}: expected cpu or cuda tensors")
        self._mla, self._index, self.fmts, self.device = mla, index, fmts, device
        index = device.index  # on_device(t): whether t is on the caches' device (a cheaper test than t.device's)
        self._on_device = attrgetter("is_cpu") if device.type == "cpu" else \
            (lambda t: t.is_cuda and t.get_device() == index)
        self.max_num_tokens, self.check = max_num_tokens, check
        self._sync_fence = check and device.type == "cuda"
        self._fence_timeout_us = max(1, int(fence_timeout_s * 1e6))
        return [("transport", transport), ("kv_cache_dtype", kv_cache_dtype), ("ds_mla_scale", ds_mla_scale),
                ("mla_k_scale", float(mla_k_scale)), ("max_num_tokens", max_num_tokens), ("check", check),
                ("layers (shape, has_indexer)", layout), ("device type", device.type)]

    def _resolve(self, transport: str) -> tuple[str, str]:
        """transport itself, or auto's choice over the group's topology: every rank's host, and per pair whether
        one can store into the other's memory (cpu: same host, shared memory; cuda: same GPU or CUDA P2P)."""
        import torch.distributed as dist

        if transport != "auto":
            return transport, ""
        me = dict(host=socket.gethostname(), uuid=None)
        if self.device.type == "cuda":
            me["uuid"] = str(torch.cuda.get_device_properties(self.device).uuid)
        every = self._gather_objects(me)
        hosts = [e["host"] for e in every]
        row = []
        for e in every:
            ok = e["host"] == me["host"]
            if ok and self.device.type == "cuda" and e["uuid"] != me["uuid"]:
                local = [i for i in range(torch.cuda.device_count())
                         if str(torch.cuda.get_device_properties(i).uuid) == e["uuid"]]
                ok = bool(local) and torch.cuda.can_device_access_peer(self.device.index, local[0])
            row.append(ok)
        access = self._gather_objects(row)
        nccl = dist.get_backend(self._group) == "nccl"
        return choose_transport(hosts, access, nccl)

    def _gather_objects(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    # ---- per layer --------------------------------------------------------------------------------------------

    def publish(self, layer_idx: int, positions: torch.Tensor, q_c: torch.Tensor, q_rms_norm_w: torch.Tensor,
                q_rms_eps: float, kv_c: torch.Tensor, kv_rms_norm_w: torch.Tensor, kv_rms_eps: float,
                k_pe: torch.Tensor, k_rope_cos_sin_cache: torch.Tensor, index_k: Optional[torch.Tensor],
                index_k_layer_norm_w: Optional[torch.Tensor], index_k_layer_norm_bias: Optional[torch.Tensor],
                index_k_layer_norm_eps: float, index_k_rope_cos_sin_cache: Optional[torch.Tensor],
                topk_indices_buffer: Optional[torch.Tensor], slot_mapping: torch.Tensor, num_decode_tokens: int, *,
                index_rope_interleave: bool = False, q_c_out: Optional[torch.Tensor] = None,
                indexer_slot_mapping: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Publishes layer layer_idx's rows of this rank's T = positions.shape[0] local tokens into every rank's
        replica (collective: every rank calls it for the same layer of the same step). Returns q_c_out (bf16
        [T, q_lora_rank] = RMSNorm(q_c); allocated when None), as vLLM's fused_norm_rope does.

        Arguments as vLLM's DeepSeek-V3.2 attention has them (module docstring): positions int64 [T]; q_c bf16
        [T, q_lora_rank], kv_c bf16 [T, 512], k_pe bf16 [T, 64] or [T, 1, 64] (row strides free: splits of one
        projection); the RMSNorm weights and eps; k_rope_cos_sin_cache [max_position, 64] ([cos 32 | sin 32], any
        float dtype); on a layer with an indexer cache index_k bf16 [T, 128], the indexer LayerNorm's weight, bias
        and eps, index_k_rope_cos_sin_cache (the same values as k_rope_cos_sin_cache: pcpkv rotates both with
        one table; the style is index_rope_interleave) and topk_indices_buffer int32 [>= T, topk] (rows [0, T)
        set to -1, as vLLM's kernel does); on a layer without one index_k and its weights are None.
        slot_mapping int64 [>= W * T]: vLLM's gathered, rank-major layer slot mapping (-1 = no row; decode copies of
        ranks > 0 are skipped whatever they hold); num_decode_tokens: the decodes at the front of every rank's
        local tokens. indexer_slot_mapping (keyword; layers with an indexer cache; ignored on others): the indexer
        rows' own slots in the same gathered form (docs/spec.md 4.2), None: slot_mapping's. Raises ValueError naming
        the argument (on every rank with check=True) before anything is written."""
        if self._closed:
            raise RuntimeError(f"{_WHERE}: publish() used after close()")
        compiling = torch.compiler.is_compiling()
        # A layer's weights and tables are the same tensors call after call (vLLM's parameters and buffers): their
        # checks and float32 copies are made once per layer and stamp (_Layer); the rest is checked every call.
        held = (q_rms_norm_w, kv_rms_norm_w, k_rope_cos_sin_cache, index_k_layer_norm_w, index_k_layer_norm_bias,
                index_k_rope_cos_sin_cache)
        m = self._layers.get(layer_idx) if type(layer_idx) is int and not compiling else None
        if m is not None:  # held: the memo's tensors at its stamp (see _Layer, _stamp)
            try:
                for t, mine, (version, ptr, dtype) in zip(held, m.held, m.stamp):
                    if t is not mine or t._version != version or t.data_ptr() != ptr or t.dtype is not dtype:
                        m = None
                        break
            except RuntimeError:  # an inference-mode tensor has no version counter
                if not (all(map(is_, held, m.held)) and _stamp(m.held) == m.stamp):
                    m = None
        why = self._check_call(m, layer_idx, num_decode_tokens, index_rope_interleave,
                               (q_rms_eps, kv_rms_eps, index_k_layer_norm_eps), positions, q_c, kv_c, k_pe, index_k,
                               topk_indices_buffer, slot_mapping, q_c_out, indexer_slot_mapping, held)
        if not why and m is None:  # the cos/sin tables: converted and the index table compared, before the verdicts
            try:
                m = self._convert(self.fmts[layer_idx].has_indexer, q_c, held)
            except ValueError as e:
                why = str(e)
            if not why and not compiling:
                m.stamp = _stamp(m.held)
                self._layers[layer_idx] = m
        T = positions.shape[0] if not why else 0
        if self.check:
            what = f"{_WHERE}.publish (layer {layer_idx})"
            share_verdicts_and_agree_on(self._gather, what, why, lambda: self._step_fields(
                layer_idx, T, num_decode_tokens, slot_mapping, index_rope_interleave, q_rms_eps, kv_rms_eps,
                index_k_layer_norm_eps, indexer_slot_mapping))
        elif why:
            raise ValueError(f"{_WHERE}.publish (layer {layer_idx}) on rank {self.rank}: {why}")
        ops = self._ops[layer_idx]
        has = ops.fmt[3]
        if q_c_out is None:
            q_c_out = torch.empty((T, q_c.shape[1]), dtype=torch.bfloat16, device=q_c.device)
        if k_pe.dim() == 3:
            k_pe = k_pe.reshape(T, 64)
        # The indexer rows' own slots (spec 4.2); None (or slot_mapping itself): one slot for both.
        own = has and indexer_slot_mapping is not None and indexer_slot_mapping is not slot_mapping
        # the dispatch op's arguments, less the slots, destinations and outputs that the transport picks
        inputs = (kv_c, k_pe, positions, m.kv_w, m.rope, q_c, m.q_w, index_k if has else None, m.ln_w, m.ln_b)
        scalars = (*ops.fmt, q_rms_eps, kv_rms_eps, index_k_layer_norm_eps, True, index_rope_interleave, False,
                   "full", 0)
        topk = topk_indices_buffer[:T] if has else None
        dispatch_op, fence_op, combine_op, insert_op = _TRACED if compiling else _OPS
        nd = num_decode_tokens
        if self.transport == "direct":
            slots, islots = self._slots(slot_mapping, T, nd, self.rank), None
            if own:
                islots = self._slots(indexer_slot_mapping, T, nd, self.rank)
            dispatch_op(*inputs, slots, *ops.dispatch_to, None, None, q_c_out, None, None, None, topk, ops.written,
                        *scalars, islots)
            fence_op(*ops.fence)
            if self._sync_fence:
                self._fence_check()
        elif self.transport == "staging":
            # Alternate buffers per call (every rank makes the same calls): a rank past this fence may write the
            # next publication's rows while a peer still combines these; by layer parity an odd layer count would
            # reuse a buffer from the last layer of a step to the first of the next.
            buf, self._staging_calls = self._staging_calls % 2, self._staging_calls + 1
            dests = ops.dispatch_to[buf]
            dispatch_op(*inputs, None, None, None, dests.table, dests.host, q_c_out, None, None, None, topk,
                        dests.tensors, *scalars, None)
            fence_op(*ops.fence)
            if self._sync_fence:
                self._fence_check()
            src = ops.combine_src[buf]
            rows = self._slots(slot_mapping, T, nd, None, src.shape[1])
            irows = self._slots(indexer_slot_mapping, T, nd, None, src.shape[1]) if own else None
            combine_op(src, rows, ops.mla, ops.index, *ops.fmt, irows)
        else:
            dev = positions.device
            outs = [torch.empty((T, n), dtype=torch.bfloat16, device=dev) for n in ((512, 64, 128) if has else
                                                                                     (512, 64))]
            dispatch_op(*inputs, None, None, None, None, None, q_c_out, outs[0], outs[1],
                        outs[2] if has else None, topk, [], *scalars, None)
            rows = [self._all_gather(t) for t in outs]  # rank-major [W * T, ...]
            insert_op(rows[0], rows[1], rows[2] if has else None, self._slots(slot_mapping, T, nd), ops.mla,
                      ops.index, *ops.fmt[:3], self._slots(indexer_slot_mapping, T, nd) if own else None)
        return q_c_out

    def _convert(self, has_indexer, q_c, held) -> _Layer:
        """A layer's memo for checked tensors: the weights and cos/sin table as float32 (each converted once per
        tensor, shared between layers), the index table compared with the MLA one (ValueError if it differs)."""
        q_w, kv_w, k_table, ln_w, ln_b, index_table = held
        f32 = self._f32
        rope = self._rope(k_table, index_table if has_indexer else None)
        if not has_indexer:
            return _Layer(held[:3], q_c.shape[1], f32(kv_w), f32(q_w), None, None, rope)
        return _Layer(held, q_c.shape[1], f32(kv_w), f32(q_w), f32(ln_w), f32(ln_b), rope)

    def _layer_ops(self, layer) -> _Ops:
        fmt, ec, o = self.fmts[layer], self.caches, _Ops()
        o.fmt = (fmt.kv_format, fmt.ds_mla_scale, fmt.k_scale, fmt.has_indexer)
        o.mla, o.index = self._mla[layer], self._index[layer]
        o.dispatch_to = o.written = o.fence = o.combine_src = None
        if ec is None:  # collect
            return o
        state = ec.fence_state
        if self.transport == "direct":
            tgt = ec.targets[layer]
            o.dispatch_to, o.written = (tgt.table, tgt.host), list(tgt.tensors)
            written = ec.mla[layer] + (ec.index[layer] or [])
        else:  # staging: the workspace of the format's row size, its two buffers' destinations
            ws, o.dispatch_to = ec.staging_for(fmt, 1)
            o.combine_src = [ws[self.rank][buf, 0] for buf in (0, 1)]
            written = ws
        o.fence = (state.pad_table, state.epochs, state.claim, state.error, state.first_rank, state.world,
                   state.num_barriers, 0, self._fence_timeout_us, list(written) + list(state.pads))
        return o

    def _slots(self, sm, T, nd, rank=None, cap=None):
        """The slots that write, from sm's first W * T entries (rank-major), the decode copies of ranks > 0 at -1
        (vLLM writes rank 0's): rank `rank`'s [T], or every rank's flat [W * T]; with cap, [W * cap] (a staging
        workspace's rows per rank: its rows past T skipped)."""
        W = self.world
        if rank is not None:
            mine = sm[rank * T:(rank + 1) * T]
            if nd > 0 and rank > 0:
                mine = mine.clone()
                mine[:nd] = -1
            return mine
        g = sm[:W * T].view(W, T)
        if cap is not None and cap != T:
            rows = torch.full((W, cap), -1, dtype=torch.int64, device=sm.device)
            rows[:, :T] = g
            g = rows
        elif nd > 0 and W > 1:
            g = g.clone()
        if nd > 0 and W > 1:
            g[1:, :nd] = -1
        return g.reshape(-1).contiguous()

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        src = t.contiguous()
        if dist.get_backend(self._group) == "gloo" and src.is_cuda:
            src = src.cpu()  # gloo gathers host memory
        outs = [torch.empty_like(src) for _ in range(self.world)]
        dist.all_gather(outs, src, group=self._group)
        return torch.cat(outs).to(t.device)

    def _fence_check(self):
        """check=True on CUDA (_sync_fence): wait for the fence and raise its timeout (naming the missing rank)."""
        torch.cuda.synchronize(self.device)
        self.caches.fence_state.check()

    def _f32(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """t as contiguous float32 (exact for bf16 weights and tables), converted once per tensor and stamp (a
        weak reference: a new tensor at a freed one's id never hits)."""
        if t is None or (t.dtype is torch.float32 and t.is_contiguous()):
            return t
        key = ("t", id(t))
        hit = self._tables.get(key)
        if hit is not None and hit[0]() is t and hit[1] == _stamp((t,)):
            return hit[2]
        f = t.to(torch.float32).contiguous()
        self._tables[key] = (weakref.ref(t), _stamp((t,)), f)
        return f

    def _rope(self, k_table: torch.Tensor, index_table: Optional[torch.Tensor]) -> torch.Tensor:
        """k_table as contiguous float32 (exact for vLLM's tables), converted once per tensor and stamp; an index
        table must hold the same values (compared once per pair; a host sync on CUDA the first time)."""
        converted = self._f32
        table = converted(k_table)
        if index_table is not None and index_table is not k_table:
            key = ("same", id(k_table), id(index_table))
            hit = self._tables.get(key)
            stamp = _stamp((k_table, index_table))
            if hit is None or hit[0]() is not k_table or hit[1]() is not index_table or hit[2] != stamp:
                if index_table.shape != k_table.shape or not torch.equal(converted(index_table), table):
                    raise ValueError(f"index_k_rope_cos_sin_cache must hold the same values as "
                                     f"k_rope_cos_sin_cache (pcpkv rotates k_pe and index_k with one table; the "
                                     f"style is index_rope_interleave), got {_desc(index_table)} vs "
                                     f"{_desc(k_table)}")
                self._tables[key] = (weakref.ref(k_table), weakref.ref(index_table), stamp)
        return table

    def _check_call(self, m, layer_idx, num_decode_tokens, interleave, eps, pos, q_c, kv_c, k_pe, index_k, topk, sm,
                    q_c_out, ism, held) -> str:
        """'' when this rank's call is good, else why (naming the argument and value). Local, no device sync.
        m: the layer's _Layer when held (the weights and tables) are its tensors at its stamp: their own checks
        passed with them and would pass again, so they are skipped; every check that reads another argument (or
        T, or q_c's width) runs on every call."""
        Tensor, bf16, i64 = torch.Tensor, torch.bfloat16, torch.int64
        W = self.world
        if m is None:  # a memo exists only at a valid layer_idx
            L = len(self.fmts)
            if not _is_int(layer_idx) or not 0 <= layer_idx < L:
                return f"layer_idx = {layer_idx!r} must be an integer in [0, {L})"
        has = self.fmts[layer_idx].has_indexer
        q_w, kv_w, k_table, ln_w, ln_b, index_table = held
        if not isinstance(pos, Tensor) or pos.dim() != 1 or pos.dtype is not i64:
            return f"positions: expected int64 [T], got {_desc(pos)}"
        T = pos.shape[0]
        if T > self.max_num_tokens:
            return f"positions: T = {T} local tokens is more than max_num_tokens = {self.max_num_tokens}"
        nd = num_decode_tokens
        if (type(nd) is not int and not _is_int(nd)) or not 0 <= nd <= T:
            return f"num_decode_tokens = {nd!r} must be an integer in [0, T = {T}]"
        if interleave is not True and interleave is not False:
            return f"index_rope_interleave = {interleave!r} must be True or False"
        a, b, c = eps
        if not (type(a) is float and type(b) is float and type(c) is float and 0 <= a < 1 and 0 <= b < 1 and
                0 <= c < 1):  # (floats in range, the common case, in one test; else the first bad one named)
            for name, v in zip(_EPS, eps):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                    return f"{name} = {v!r} must be a float in [0, 1)"
        if not isinstance(q_c, Tensor) or q_c.dtype is not bf16 or q_c.dim() != 2 or q_c.shape[0] != T:
            return f"q_c: expected bf16 [T = {T}, q_lora_rank], got {_desc(q_c)}"
        if not isinstance(kv_c, Tensor) or kv_c.dtype is not bf16 or kv_c.shape != (T, 512):
            return f"kv_c: expected bf16 [T = {T}, 512], got {_desc(kv_c)}"
        if not isinstance(k_pe, Tensor) or k_pe.dtype is not bf16 or (k_pe.shape != (T, 64) and
                                                                      k_pe.shape != (T, 1, 64)):
            t = k_pe.reshape(T, 64) if isinstance(k_pe, Tensor) and k_pe.shape == (T, 1, 64) else k_pe
            return f"k_pe: expected bf16 [T = {T}, 64], got {_desc(t)}"
        if m is None or q_c.shape[1] != m.q_lora:
            weights = [("q_rms_norm_w", q_w, q_c.shape[1]), ("kv_rms_norm_w", kv_w, 512)]
            if has:
                weights += [("index_k_layer_norm_w", ln_w, 128), ("index_k_layer_norm_bias", ln_b, 128)]
            for name, t, n in weights:  # converted to float32 (once): an integer weight would convert silently
                if not isinstance(t, Tensor) or not t.is_floating_point() or tuple(t.shape) != (n,):
                    return f"{name}: expected a floating-point [{n}] weight, got {_desc(t)}"
        if not isinstance(sm, Tensor) or sm.dim() != 1 or sm.dtype is not i64 or sm.shape[0] < W * T:
            return (f"slot_mapping: expected int64 [>= W * T = {W} * {T}] (vLLM's gathered, rank-major layer slot "
                    f"mapping), got {_desc(sm)}")
        if ism is not None and (not isinstance(ism, Tensor) or ism.dim() != 1 or ism.dtype is not i64 or
                                ism.shape[0] < W * T):
            return (f"indexer_slot_mapping: expected None or int64 [>= W * T = {W} * {T}] (the indexer rows' own "
                    f"slots, gathered and rank-major as slot_mapping), got {_desc(ism)}")
        if m is None and (not isinstance(k_table, Tensor) or k_table.dim() != 2 or k_table.shape[1] != 64 or
                          not k_table.is_floating_point()):
            return f"k_rope_cos_sin_cache: expected a float [max_position, 64] table, got {_desc(k_table)}"
        if has:
            if m is None or index_k is None or topk is None:
                for name, v in zip(_INDEXER, (index_k, ln_w, ln_b, index_table, topk)):
                    if v is None:
                        return f"{name} is None, but layer {layer_idx} has an indexer cache (indexer_k_caches[" \
                               f"{layer_idx}])"
            if not isinstance(index_k, Tensor) or index_k.dtype is not bf16 or index_k.shape != (T, 128):
                return f"index_k: expected bf16 [T = {T}, 128], got {_desc(index_k)}"
            if not isinstance(topk, Tensor) or topk.dtype is not torch.int32 or topk.dim() != 2 or topk.shape[0] < T:
                return f"topk_indices_buffer: expected int32 [>= T = {T}, topk], got {_desc(topk)}"
        elif index_k is not None:
            return (f"index_k is given, but layer {layer_idx} has no indexer cache (indexer_k_caches[{layer_idx}] "
                    "is None)")
        # every tensor but the cos/sin tables on the caches' device (held ones: their stamp's data_ptr)
        on = self._on_device
        if m is not None and has:
            # (every one a tensor here but q_c_out and ism: the common case in one pass, the loop names the first)
            if all(map(on, (pos, q_c, kv_c, k_pe, index_k, topk, sm))) and \
                    (q_c_out is None or not isinstance(q_c_out, Tensor) or on(q_c_out)) and (ism is None or on(ism)):
                return ""
            names, ts = _PER_CALL_ON_DEVICE, (pos, q_c, kv_c, k_pe, index_k, topk, sm, q_c_out, ism)
        else:
            names, ts = _ON_DEVICE, (pos, q_c, kv_c, k_pe, index_k, q_w, kv_w, ln_w, ln_b, topk, sm, q_c_out, ism)
        for i, t in enumerate(ts):
            if t is not None and isinstance(t, Tensor) and not on(t):
                return f"{names[i]} is on {t.device}, the caches on {self.device}"
        return ""

    def _step_fields(self, layer_idx, T, num_decode_tokens, slot_mapping, interleave, q_eps, kv_eps, index_eps,
                     indexer_slot_mapping=None):
        """What every rank must share for one layer of one step; the slot mappings by their sha256 (host copies)."""
        def digest_of(m):
            return hashlib.sha256(m[:self.world * T].detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
        own = indexer_slot_mapping is not None and indexer_slot_mapping is not slot_mapping
        return [("layer_idx", layer_idx), ("T (local tokens)", T), ("num_decode_tokens", num_decode_tokens),
                ("slot_mapping (sha256 of its first W * T entries)", digest_of(slot_mapping)),
                ("index_rope_interleave", interleave), ("q_rms_eps", float(q_eps)), ("kv_rms_eps", float(kv_eps)),
                ("index_k_layer_norm_eps", float(index_eps))] + \
            ([("indexer_slot_mapping (sha256 of its first W * T entries)", digest_of(indexer_slot_mapping))]
             if own else [])

    # ---- teardown ---------------------------------------------------------------------------------------------

    def close(self):
        """Releases every peer mapping (local; the peers need not be alive). Later publish() raises."""
        if self.caches is not None:
            self.caches.close()
        self._tables, self._layers, self._ops, self._closed = {}, {}, [], True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
