"""A HF DeepSeek-V3.2 / GLM-5 causal LM whose attention layers run under PCP through pcpkv (PcpModel).

The HF model keeps its embedding, decoder-layer norms, MLP / MoE, final norm and lm_head, run by HF's own
forward on hidden states in global token order (token-wise work: W logical ranks in one process batch their
rows); every decoder layer's self_attn is a PcpAttention, which runs each rank's projections on its own rows,
publishes them with pcpkv into every replica, and attends from each rank's own replica (attention.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import torch

from ..consumers import INDEXER_MAX_HEADS, INDEXER_MAX_TOPK
from ..model_spec import ModelSpec
from ..plan import check_plan_modes
from .attention import PcpAttention, PcpRuntime
from .batch import BlockTables, StepBatch, StepRequest
from .world import TRANSPORTS, PcpWorld

__all__ = ["PcpModel"]


class _NoMask(defaultdict):
    """HF's per-layer-type mask mapping with no mask for any type: PcpAttention masks by positions (the indexer
    is causal within each request) and HF must not build a dense [N, N] mask."""

    def __init__(self):
        super().__init__(lambda: None)


def _check_kernel_limits(cfg):
    """Refuses (ValueError naming the config field and value) what pcpkv's indexer kernels cannot run: it failed
    in the first layer's indexer, part-way through a step."""
    for field, hi in (("index_topk", INDEXER_MAX_TOPK), ("index_n_heads", INDEXER_MAX_HEADS)):
        v = getattr(cfg, field, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi):
            raise ValueError(f"hf_model.config.{field} = {v!r} must be an int in [1, {hi}] (pcpkv's indexer "
                             "kernels)")


class PcpModel:
    """hf_model (GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM, eval, any dtype; its weights are used in place)
    prefilled under PCP over pcp_world logical ranks of one device (transport: collect | staging | direct | auto;
    auto picks direct here, the ranks sharing one device, and sets transport_reason). kv_format: "fp8_ds_mla" |
    "fp8" | "bf16"
    (the MLA cache row; the indexer cache is FP8 always, SPEC section 3). num_blocks x block_size slots per
    replica (block 0 is the null block); max_positions: the RoPE table (default: the config's
    max_position_embeddings, capped at what the blocks can hold). step() runs one forward step of any mix of
    fresh prefills, chunked prefills with cached context and decodes; requests keep their blocks across steps.
    row_chunk: see attention.py (None: projections on whole local batches, faster, not batch-invariant).
    timing: per (layer, stage) seconds in runtime.times (synchronizing); record_topk: keep every layer's top-k
    (topk_positions); scale_read: how sparse MLA reads fp8_ds_mla tile scales ("fp32" | "bf16", FlashMLA SM90);
    poison: fill outputs with NaN before the dispatch writes them (tests). check_replicas: the run-time replica
    check after every layer's publication (models/replica_check.py; None: PCPKV_CHECK_REPLICAS=1 turns it on).
    make_world: the world's class (default PcpWorld: pcp_world logical ranks here; DistPcpModel passes
    DistPcpWorld, one rank per process). local_order / decode_ownership: the plan modes of every step (SPEC
    section 4.1; pcpkv_torch.LOCAL_ORDERS, DECODE_OWNERSHIPS); logits and cache bytes do not depend on them.
    Raises ValueError for a config pcpkv cannot serve (kv_lora_rank != 512, ...; index_topk or index_n_heads
    past the indexer kernels' bounds, naming the field and value), a bad transport, or a step that needs more
    blocks than are free or reaches past max_position_embeddings / max_positions (refused before any block is
    reserved). A step is all or nothing: one that fails part-way (any exception) leaves the blocks (and their
    order), every request's cached tokens and the last step's top-k as they were, so it can be retried."""

    def __init__(self, hf_model, pcp_world: int, *, num_blocks: int, block_size: int = 64,
                 kv_format: str = "fp8_ds_mla", ds_mla_scale: str = "pow2", transport: str = "direct",
                 max_positions: Optional[int] = None, row_chunk: Optional[int] = 64, seed: int = 0,
                 timing: bool = False, record_topk: bool = False, scale_read: str = "fp32", poison: bool = False,
                 check_replicas: Optional[bool] = None, make_world=None, local_order: str = "request",
                 decode_ownership: str = "replicated"):
        check_plan_modes(local_order, decode_ownership)
        self.local_order, self.decode_ownership = local_order, decode_ownership
        if transport not in TRANSPORTS + ("auto",):
            raise ValueError(f"transport = {transport!r}; expected one of {TRANSPORTS} or 'auto'")
        if not isinstance(pcp_world, int) or pcp_world < 1:
            raise ValueError(f"pcp_world = {pcp_world!r} must be an int >= 1")
        if row_chunk is not None and (not isinstance(row_chunk, int) or row_chunk < 1):
            raise ValueError(f"row_chunk = {row_chunk!r} must be an int >= 1 or None")
        if scale_read not in ("fp32", "bf16"):
            raise ValueError(f"scale_read = {scale_read!r}; expected 'fp32' or 'bf16'")
        layers = getattr(getattr(hf_model, "model", None), "layers", None)
        if layers is None or getattr(hf_model.config, "model_type", None) not in ("glm_moe_dsa", "deepseek_v32"):
            raise ValueError("hf_model: expected a GlmMoeDsaForCausalLM or DeepseekV32ForCausalLM")
        if any(isinstance(layer.self_attn, PcpAttention) for layer in layers):
            raise ValueError("hf_model: its attention is already a PcpAttention (restore() the other PcpModel first)")
        self.hf = hf_model
        cfg = hf_model.config
        self.blocks = BlockTables(num_blocks, block_size, seed=seed)
        self.spec = ModelSpec.from_hf_config(cfg.to_dict() | {"model_type": cfg.model_type})
        _check_kernel_limits(cfg)
        device = next(hf_model.parameters()).device
        if max_positions is not None and (isinstance(max_positions, bool) or not isinstance(max_positions, int)
                                          or max_positions < 1):  # 0 was refused as rope_table's num_positions
            raise ValueError(f"max_positions = {max_positions!r} must be an int >= 1 or None")
        if max_positions is None:
            max_positions = min(int(cfg.max_position_embeddings), num_blocks * block_size)
        # A step reaching past either bound is refused before a block is reserved (it failed in the first layer's
        # publication with its blocks kept and its tokens marked cached).
        mpe = getattr(cfg, "max_position_embeddings", None)
        self._max_positions = ((int(mpe), "max_position_embeddings") if mpe is not None and int(mpe) <= max_positions
                               else (max_positions, "max_positions"))
        self.world = (make_world or PcpWorld)(self.spec, pcp_world, len(layers), num_blocks, block_size,
                                              kv_format=kv_format, ds_mla_scale=ds_mla_scale,
                                              max_positions=max_positions, device=device, check_replicas=check_replicas)
        # "auto": decided once here; transport_reason says why (also logged on the "pcpkv_torch" logger).
        transport, self.transport_reason = self.world.resolve_transport(transport)
        self.runtime = PcpRuntime(self.world, transport=transport, row_chunk=row_chunk, timing=timing,
                                  record_topk=record_topk, scale_read=scale_read, poison=poison)
        self.transport = transport
        self._restored = False
        returns_topk = cfg.model_type == "glm_moe_dsa"
        self._hf_attn = []
        for i, layer in enumerate(layers):
            self._hf_attn.append(layer.self_attn)
            layer.self_attn = PcpAttention(layer.self_attn, i, self.runtime, returns_topk=returns_topk)
        self._mlp_hooks = []
        if timing:
            for i, layer in enumerate(layers):
                self._mlp_hooks.append(layer.mlp.register_forward_pre_hook(
                    lambda m, a, i=i: setattr(self, "_t_mlp", self.runtime.tick())))
                self._mlp_hooks.append(layer.mlp.register_forward_hook(
                    lambda m, a, o, i=i: self.runtime.add_time(i, "mlp", self._t_mlp)))

    def restore(self):
        """Puts HF's own attention modules back (the model is HF's again)."""
        for layer, attn in zip(self.hf.model.layers, self._hf_attn):
            layer.self_attn = attn
        for h in self._mlp_hooks:
            h.remove()
        self._mlp_hooks = []
        self._restored = True

    def topk_positions(self, layer_idx: int) -> torch.Tensor:
        """The last step's top-k selection of layer layer_idx (record_topk=True) as key positions int64
        [N, topk] in global token order (each token's owner rank; -1 tail), on the CPU."""
        batch, sel = self.runtime.step, self.runtime.topk[layer_idx]
        pos_of_slot = self.blocks.position_of_slot()
        out = torch.full((batch.num_tokens, sel[0].shape[1]), -1, dtype=torch.int64)
        for r, k in enumerate(sel):
            if k is None:  # a rank of another process (DistPcpModel): its tokens stay -1 here
                continue
            k = k.cpu().long()
            p = torch.where(k >= 0, pos_of_slot[k.clamp(min=0)], torch.full_like(k, -1))
            own = batch.owner[r].cpu()
            out[batch.global_index[r].cpu()[own]] = p[own]
        return out

    @torch.no_grad()
    def step(self, requests: Sequence[StepRequest], *, transport: Optional[str] = None,
             output_hidden_states: bool = False):
        """One forward step. Returns (logits [N, vocab] in global token order, hidden_states or None: the
        embedding output and every decoder layer's output [N, hidden] as HF's output_hidden_states gives them,
        the last one after the final norm), N = all new tokens of the step, requests in order.
        Bad requests raise ValueError before anything changes; an exception part-way rolls the step back (blocks,
        cached token counts, top-k) and propagates. DistPcpModel: the ranks' requests, transport and cache state
        are compared first (agreement.step_entries); a mismatch raises ValueError on every rank."""
        if self._restored:
            raise RuntimeError("PcpModel.step: restore() already put HF's attention back; build a new PcpModel")
        # Every rank of a DistPcpModel must run this very step on the same cache state: compared by a digest
        # before any work (a no-op with every rank in this process).
        self.world.agree_step(requests, transport, self.blocks)
        if transport is not None:
            transport, _ = self.world.resolve_transport(transport)
        vocab = int(self.hf.config.vocab_size)
        for i, q in enumerate(requests):
            t = q.token_ids
            if isinstance(t, torch.Tensor) and t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
                raise ValueError(f"requests[{i}] ({q.request_id!r}).token_ids: ids must be in [0, {vocab}), got "
                                 f"[{int(t.min())}, {int(t.max())}]")
        device = self.world.device
        rt = self.runtime
        # A step that fails part-way (an exception in the forward, a peer gone) leaves nothing behind: its blocks go
        # back, no token is marked cached, the last step's batch and top-k stay what topk_positions() reads. Cache
        # bytes it wrote lie in slots no request holds as cached, overwritten when the step is retried.
        saved = (self.blocks.snapshot(), rt.step, rt.transport, dict(rt.topk), dict(rt.times))
        try:
            limit, name = self._max_positions
            batch = StepBatch(self.world.W, requests, self.blocks, device, local_order=self.local_order,
                              decode_ownership=self.decode_ownership, max_positions=limit, max_positions_name=name)
            rt.step = batch
            rt.transport = transport or self.transport
            out = self.hf(input_ids=batch.input_ids.to(device)[None],
                          position_ids=torch.as_tensor(batch.global_positions, device=device)[None],
                          attention_mask=_NoMask(), use_cache=False, output_hidden_states=output_hidden_states)
            hidden = [h[0] for h in out.hidden_states] if output_hidden_states else None
            return out.logits[0], hidden
        except BaseException:
            snap, rt.step, rt.transport, rt.topk, rt.times = saved
            self.blocks.restore(snap)
            raise
