"""Test helpers: seeded LLM-like inputs and a W-logical-rank "world" that publishes one layer with the ops."""

import contextlib
import logging

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
try:
    import pcpkv_torch as pk
except ImportError as e:  # extension not built
    pytest.skip(f"pcpkv_torch is not importable: {e}", allow_module_level=True)


def _why_no_cuda():
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if pk.cuda_dispatch_impl() == "none":
        return "pcpkv_torch was built without CUDA (PCPKV_TORCH_CUDA=0 or no nvcc)"
    return None


WHY_NO_CUDA = _why_no_cuda()
requires_cuda = pytest.mark.skipif(WHY_NO_CUDA is not None, reason=WHY_NO_CUDA or "")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
GUARD = 0xA5          # cache guard byte
POISON_BF16 = 7.0     # materialized outputs before a run: an unwritten output keeps it and fails the check
POISON_I32 = 7        # top-k buffers before a run (the op writes -1)


def poisoned_bf16(rows, cols, device):
    """A bf16 [rows, cols] output buffer filled with POISON_BF16 (outputs are never read uninitialized)."""
    return torch.full((rows, cols), POISON_BF16, dtype=torch.bfloat16, device=device)


def llm_like(gen, rows, cols, *, num_outliers=4, outlier_gain=30.0, scale=1.0):
    """bf16 [rows, cols]: Gaussian channels, per-token log-normal magnitude, a few outlier channels
    outlier_gain times larger. Never all zeros."""
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    x *= torch.exp(0.5 * torch.randn(rows, 1, generator=gen, dtype=torch.float64)) * scale
    idx = torch.randperm(cols, generator=gen)[:num_outliers]
    x[:, idx] *= outlier_gain
    return x.to(torch.bfloat16)


def norm_weight(gen, n, spread=0.25):
    """Weights near 1 with spread, bf16-representable (a checkpoint's values), as float32."""
    return (1.0 + spread * torch.randn(n, generator=gen, dtype=torch.float64)).to(torch.bfloat16).float()


class World:
    """W logical PCP ranks of one layer on one device: local inputs from a plan, a replica and a staging
    workspace per rank (padded strides, guard bytes), fence state, and the tables of both transports."""

    def __init__(self, plan, fmt, device, *, seed=0, q_lora_rank=256, topk_width=64, index_rope_interleaved=False,
                 rope=None, row_pad=16, block_pad=64, index_block_pad=32):
        gen = torch.Generator().manual_seed(seed)
        self.plan, self.fmt, self.device = plan, fmt, torch.device(device)
        W, M = plan.pcp_world, plan.max_local_tokens
        self.W, self.M = W, M
        N = plan.global_slots.numel()
        g = dict(q_c=llm_like(gen, N, q_lora_rank), kv=llm_like(gen, N, 512), k_pe=llm_like(gen, N, 64, scale=2.0),
                 index_k=llm_like(gen, N, 128))
        self.weights = dict(q_norm_w=norm_weight(gen, q_lora_rank), kv_norm_w=norm_weight(gen, 512),
                            index_ln_w=norm_weight(gen, 128), index_ln_b=0.1 * norm_weight(gen, 128))
        self.weights = {k: v.to(self.device) for k, v in self.weights.items()}
        rope = rope or pk.RopeSpec("deepseek_yarn", 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
        self.rope_cos_sin = pk.rope_table(rope, int(plan.global_positions.max()) + 1, self.device)
        self.index_rope_interleaved = index_rope_interleaved
        self.local = []
        for r in range(W):
            gidx = plan.global_index[r]
            real = gidx >= 0
            loc = {}
            for k, v in g.items():
                junk = llm_like(gen, M, v.shape[1])  # engines leave garbage in padding rows
                junk[real] = v[gidx[real]]
                loc[k] = junk.to(self.device)
            loc["positions"] = plan.positions[r].to(self.device)
            loc["slot_mapping"] = plan.slot_mapping[r].to(self.device)
            # Outputs start poisoned: torch.empty could hand back a block a previous test filled with exactly
            # the expected values (the CUDA caching allocator reuses same-size blocks), hiding a missing write.
            loc["q_c_out"] = torch.full((M, q_lora_rank), POISON_BF16, dtype=torch.bfloat16, device=self.device)
            loc["topk"] = torch.full((M, topk_width), POISON_I32, dtype=torch.int32, device=self.device)
            self.local.append(loc)
        self.mla = [pk.allocate_mla_cache(plan.num_blocks, plan.block_size, fmt.kv_format, self.device,
                                          row_pad=row_pad, block_pad=block_pad, fill=GUARD) for _ in range(W)]
        self.idx = [pk.allocate_indexer_cache(plan.num_blocks, plan.block_size, self.device,
                                              block_pad=index_block_pad, fill=GUARD) for _ in range(W)]
        self.staging = [pk.allocate_staging(W, M, fmt, self.device, fill=0) for _ in range(W)]
        self.gathered = plan.gathered_slot_mapping.to(self.device)
        self.targets = pk.CacheTargets.from_caches(self.mla, self.idx if fmt.has_indexer else None, fmt)
        self.dests = [pk.RowDests.from_staging(self.staging, r) for r in range(W)]
        self.pads = pk.allocate_fence_pads(W, num_barriers=2, device=self.device)
        self.fence_state = pk.FenceState.local(self.pads, num_barriers=2)

    def flat(self, t):
        """The whole allocation behind a cache view (guard and padding bytes included)."""
        return torch.as_strided(t, (t.untyped_storage().nbytes(),), (1,), 0)

    def poison(self):
        for t in self.mla + self.idx:
            self.flat(t).fill_(GUARD)
        for r in range(self.W):
            self.local[r]["q_c_out"].fill_(POISON_BF16)
            self.local[r]["topk"].fill_(POISON_I32)

    def dispatch(self, r, *, targets=None, row_dests=None, **extra):
        loc = self.local[r]
        w = self.weights
        pk.dispatch(loc["kv"], loc["k_pe"], loc["positions"], w["kv_norm_w"], self.rope_cos_sin, fmt=self.fmt,
                    q_c=loc["q_c"], q_norm_w=w["q_norm_w"], q_c_out=loc["q_c_out"],
                    index_k=loc["index_k"] if self.fmt.has_indexer else None,
                    index_ln_w=w["index_ln_w"] if self.fmt.has_indexer else None,
                    index_ln_b=w["index_ln_b"] if self.fmt.has_indexer else None,
                    slot_mapping=loc["slot_mapping"], targets=targets, row_dests=row_dests,
                    topk_fill=loc["topk"] if self.fmt.has_indexer else None, kv_eps=1e-6, q_eps=1e-6,
                    index_rope_interleaved=self.index_rope_interleaved, **extra)

    def publish(self, transport, barrier_idx=0):
        """One layer's publication of every rank (SPEC section 5)."""
        if transport == "direct":
            for r in range(self.W):
                self.dispatch(r, targets=self.targets)
            pk.fence(self.fence_state, barrier_idx, written=self.mla + self.idx)
        elif transport == "staging":
            for r in range(self.W):
                self.dispatch(r, row_dests=self.dests[r])
            pk.fence(self.fence_state, barrier_idx, written=self.staging)
            for r in range(self.W):
                pk.combine(self.staging[r][0, 0], self.gathered, self.mla[r], self.idx[r] if self.fmt.has_indexer
                           else None, fmt=self.fmt)
        else:
            raise ValueError(transport)

    def replica_bytes(self, r):
        return self.flat(self.mla[r]).cpu(), self.flat(self.idx[r]).cpu()


def replica_hash_pattern():
    """(mla uint8 [2, 4, 656], index uint8 [2, 4, 132]): the replica whose bytes come from the formula of
    tests/publish/test_replica_hash.cpp, for the replica hash's fixed values (docs/spec.md 5.2)."""
    mla = torch.empty(2, 4, 656, dtype=torch.uint8)
    idx = torch.empty(2, 4, 132, dtype=torch.uint8)
    flat = idx.view(2, 4 * 132)  # per block: 4 rows of 128 e4m3, then 4 fp32 scales (SPEC section 3)
    for s in range(8):
        b, o = divmod(s, 4)
        mla[b, o] = torch.tensor([(s * 31 + j * 7 + 3) & 255 for j in range(656)], dtype=torch.uint8)
        flat[b, o * 128:(o + 1) * 128] = torch.tensor([(s * 17 + j * 11 + 5) & 255 for j in range(128)],
                                                      dtype=torch.uint8)
        flat[b, 4 * 128 + o * 4:4 * 128 + o * 4 + 4] = torch.tensor([(s * 13 + k * 29 + 1) & 255 for k in range(4)],
                                                                    dtype=torch.uint8)
    return mla, idx


def as_int64(v: int) -> int:
    """A uint64 hash as the two's-complement int64 pcpkv_torch's hashes hold."""
    return v - (1 << 64) if v >> 63 else v


def assert_bytes_equal(a, b, what):
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape, f"{what}: sizes {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a != b).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} bytes differ, first at {diff[0].tolist()}"


@contextlib.contextmanager
def captured_logs(logger="pcpkv_torch", level=logging.INFO):
    """The messages `logger` emits at `level` or above inside the block, as a list of str. A handler of its
    own, not pytest's caplog: the device runner (run_device_tests.sh) disables pytest's logging plugin."""
    lines = []

    class _Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log, handler = logging.getLogger(logger), _Lines(level)
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def require_hf_models(*model_types):
    """Skips the calling test module unless transformers is installed and has each HF model type (e.g.
    "glm_moe_dsa", "deepseek_v32"; transformers >= 5.17)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    try:
        from pcpkv_torch.models.hf import hf_modules
        for model_type in model_types:
            hf_modules(model_type)
    except ImportError as e:
        pytest.skip(f"transformers lacks {' / '.join(model_types)} (needs >= 5.17): {e}", allow_module_level=True)
