"""A whole model's PCP prefill through pcpkv_torch.models, small configs with the real per-layer cache
dims (kv_lora 512, rope 64, index head 128, q_lora 2048 GLM-5 / 1536 DeepSeek-V3.2), 4 layers, seeded random
weights with outlier channels, prompts longer than index_topk (64) so the selection matters.

(a) PCP-P == PCP-1, bit for bit: logits of every step of a schedule with uneven prompts, a chunked prefill over
    cached context and decodes, for every transport and P = 2, 4, 8; every replica of every layer byte-identical
    (and equal to the P = 1 cache); staging == direct (logits and cache bytes).
(b) Against HF transformers' own eager forward of the same weights (bf16 activations, its DSA indexer and masked
    attention, no FP8), one request prefilled in two chunks then decoded, P = 4:
    b1. top-k overlap: per indexer layer, the mean fraction of HF's own selection (its indexer on that layer's
        input in the b2 run) that pcpkv's FP8 indexer selects too. Bound >= 0.9: the FP8 scores are within ~2^-3 relative of HF's (E4M3 q and k, each 2^-4),
        so only keys near the k-th score swap.
    b2. with HF's indexer made to return pcpkv's selection (so both attend over the same keys), the per-token
        relative error |h - h_hf| / |h_hf| of every layer's hidden state <= layers * 2^-4 (fp8_ds_mla: an E4M3
        value is within 2^-4 relative; errors of the layers add) or layers * 2^-6 (bf16 cache: HF rounds to
        bf16, 2^-8, about four times per layer where pcpkv rounds once), the cosine similarity >= 1 - e^2 / 2 of
        that bound e, the max relative logit error (max |dlogit| / max |logit| per token) <= the same e, and
        next-token top-1 agreement on every token whose HF top-2 margin exceeds twice its max logit error.
    The dense-MLP config is used for (b): MoE routing is discrete, so a tiny hidden-state difference can pick
    another expert; (a) runs MoE layers (exact equality does not care).
Measured values are printed (pytest -s).
"""

import functools

import pytest

from helpers import DEVICES, require_hf_models, torch

require_hf_models("glm_moe_dsa", "deepseek_v32")
from pcpkv_torch.models import PcpModel, StepRequest, build_hf_model, small_config
from pcpkv_torch.models.hf import hf_reference_forward

MODELS = ["glm-5", "deepseek-v3.2"]
TRANSPORTS = ["collect", "staging", "direct"]
LAYERS = 4
TOPK = 64
BLOCK = 16
NUM_BLOCKS = 48


def tokens(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


# Three steps: uneven fresh prefills; a chunked prefill over cached context next to a decode; decodes.
A, B = tokens(230, 1), tokens(77, 2)
SCHEDULE = [
    [StepRequest("a", A[:150]), StepRequest("b", B[:75])],
    [StepRequest("a", A[150:210], context_len=150), StepRequest("b", B[75:76], context_len=75, decode=True)],
    [StepRequest("a", A[210:211], context_len=210, decode=True), StepRequest("b", B[76:77], context_len=76,
                                                                               decode=True)],
]


@functools.lru_cache(maxsize=None)
def hf_model(model, device, dense=False):
    cfg = small_config(model, num_layers=LAYERS, index_topk=TOPK, first_dense=LAYERS if dense else 1)
    return build_hf_model(cfg, seed=7 if model == "glm-5" else 8, device=device)


def run(model, device, P, transport, kv_format="fp8_ds_mla", schedule=SCHEDULE, dense=False, **kw):
    """Logits of every step (CPU), every layer's replicas (CPU bytes), and the PcpModel (restored)."""
    pcp = PcpModel(hf_model(model, device, dense), P, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_format=kv_format,
                   transport=transport, poison=True, **kw)
    try:
        out = [pcp.step(s, output_hidden_states=kw.get("record_topk", False)) for s in schedule]
        replicas = [[pcp.world.replica_bytes(layer, r) for r in range(P)] for layer in range(LAYERS)]
    finally:
        pcp.restore()
    return out, replicas, pcp


def assert_replicas(replicas, reference, what):
    for layer, reps in enumerate(replicas):
        for r, (mla, idx) in enumerate(reps):
            want_mla, want_idx = reference[layer][0]
            assert torch.equal(mla, want_mla), f"{what}: layer {layer} rank {r} MLA replica differs"
            assert (idx is None) == (want_idx is None)
            if idx is not None:
                assert torch.equal(idx, want_idx), f"{what}: layer {layer} rank {r} indexer replica differs"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("model", MODELS)
def test_pcp_logits_bit_identical_to_one_rank(model, transport, device):
    ref, ref_replicas, _ = run(model, device, 1, transport)
    for step, (logits, _) in enumerate(ref):
        assert torch.isfinite(logits.float()).all(), f"step {step}: non-finite logits (an unwritten row?)"
    assert_replicas(ref_replicas, ref_replicas, f"{model} {transport} P=1")
    for P in (2, 4, 8):
        got, replicas, _ = run(model, device, P, transport)
        for step, ((a, _), (b, _)) in enumerate(zip(got, ref)):
            diff = (a != b).any(dim=-1).nonzero()
            assert diff.numel() == 0, (f"{model} {transport} P={P} step {step}: logits of {diff.numel()} tokens "
                                       f"differ from P=1, first token {int(diff[0])}")
        assert_replicas(replicas, ref_replicas, f"{model} {transport} P={P} vs P=1")
    print(f"\n{model} {transport}: P=2,4,8 logits and every replica == P=1 over {len(SCHEDULE)} steps")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", MODELS)
def test_staging_equals_direct(model, device):
    staging, rs, _ = run(model, device, 4, "staging")
    direct, rd, _ = run(model, device, 4, "direct")
    for step, ((a, _), (b, _)) in enumerate(zip(staging, direct)):
        assert torch.equal(a, b), f"{model} step {step}: staging and direct logits differ"
    assert_replicas(rs, rd, f"{model} staging vs direct")


# One request: a prefill in two chunks (the second over cached context), then a decode.
C = tokens(300, 3)
HF_SCHEDULE = [[StepRequest("c", C[:180])], [StepRequest("c", C[180:299], context_len=180)],
               [StepRequest("c", C[299:300], context_len=299, decode=True)]]


def hf_forward(model, device, ids, inject=None):
    """HF's eager forward of the dense model (pcpkv_torch.models.hf_reference_forward)."""
    return hf_reference_forward(hf_model(model, device, True), ids, inject)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("model", MODELS)
def test_against_hf_transformers(model, kv_format, device):
    out, _, pcp = run(model, device, 4, "direct", kv_format=kv_format, schedule=HF_SCHEDULE, dense=True,
                      record_topk=True)
    # The run keeps only the last step's top-k: rerun step by step to collect every step's selection.
    pcp2 = PcpModel(hf_model(model, device, True), 4, num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_format=kv_format,
                    transport="direct", poison=True, record_topk=True)
    sel = {}
    try:
        for s in HF_SCHEDULE:
            pcp2.step(s)
            for layer in pcp2.runtime.topk:
                sel.setdefault(layer, []).append(pcp2.topk_positions(layer))
    finally:
        pcp2.restore()
    sel = {k: torch.cat(v) for k, v in sel.items()}
    logits = torch.cat([lg.float().cpu() for lg, _ in out])
    hidden = [torch.cat([h[i].float().cpu() for _, h in out]) for i in range(len(out[0][1]))]
    ids = C
    # HF with pcpkv's selection injected; hf_sel = what HF's own indexer selected in that run, on inputs that
    # differ from pcpkv's only by the bounded errors of b2 (an HF run on its own selection would compound
    # earlier layers' swaps into later layers' inputs)
    hf_logits, hf_hidden, hf_sel = hf_forward(model, device, ids, inject=sel)
    # b1: HF's own selection vs pcpkv's
    for layer, hs in hf_sel.items():
        mine = sel[layer]
        overlaps = []
        for t in range(ids.numel()):
            want = set(v for v in hs[t].tolist() if v <= t)
            got = set(v for v in mine[t].tolist() if v >= 0)
            overlaps.append(len(want & got) / len(want))
        mean = sum(overlaps) / len(overlaps)
        print(f"\n{model} {kv_format} layer {layer}: top-k overlap with HF mean {mean:.4f} min {min(overlaps):.3f}")
        assert mean >= 0.9, f"layer {layer}: mean top-k overlap {mean:.4f} < 0.9"
    # b2: same selection in HF
    e = LAYERS * (2.0 ** -4 if kv_format == "fp8_ds_mla" else 2.0 ** -6)
    for i, (a, b) in enumerate(zip(hidden, hf_hidden)):
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
        print(f"{model} {kv_format} hidden {i}: max relative error {rel:.3g} (bound {e:.3g}), min cosine {cos:.6f}")
        assert rel <= e and cos >= 1 - e * e / 2, f"hidden state {i}: relative error {rel:.3g}, cosine {cos:.6f}"
    err = (logits - hf_logits).abs().amax(dim=-1)
    rel = (err / hf_logits.abs().amax(dim=-1)).max().item()
    top2 = hf_logits.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    agree = logits.argmax(-1) == hf_logits.argmax(-1)
    print(f"{model} {kv_format} logits: max relative error {rel:.3g} (bound {e:.3g}); top-1 agreement "
          f"{agree.float().mean().item():.3f} overall, {agree[clear].float().mean().item():.3f} on {int(clear.sum())} "
          "tokens with a clear margin")
    assert rel <= e, f"max relative logit error {rel:.3g} > {e:.3g}"
    assert bool(agree[clear].all()), "next-token top-1 differs on a token with a clear margin"
