"""Fake (meta) kernels of the mutating ops, so torch.compile / FakeTensor tracing and CUDA-graph capture
through torch.compile can handle them: they return nothing and allocate nothing (all outputs are
caller-provided, marked mutable in the schemas)."""

import torch


def _register():
    for name in ("dispatch", "combine", "insert", "fence", "quantize_index_q", "quantize_index_q_aten", "indexer_topk",
                 "sparse_mla", "lse_merge"):
        def _fake(*args, **kwargs):
            return None

        torch.library.register_fake(f"pcpkv::{name}")(_fake)


_register()
