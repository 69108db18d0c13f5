"""pcpkv_torch: PyTorch custom ops (namespace ``torch.ops.pcpkv``) for pcpkv's PCP KV-cache publication.

Importing the package loads the compiled library (pcpkv_torch._C, built by python/setup.py) and registers
the fake kernels. Without torch only the pure-Python model spec (pcpkv_torch.model_spec) imports.
"""

from . import model  # noqa: F401  (model_spec's former name: pcpkv_torch.model keeps working)
from .model_spec import MLA_ROW_BYTES, CacheFormat, ModelSpec, RopeSpec, transport_row_bytes

try:
    import torch as _torch
except ImportError:  # pure-Python parts only
    _torch = None

if _torch is not None:
    try:
        from . import _C  # noqa: F401  registers torch.ops.pcpkv.*
    except ImportError as e:
        raise ImportError(
            "pcpkv_torch._C is not built: run `python setup.py build_ext --inplace` in python/ "
            f"or `pip install --no-build-isolation ./python` ({e})") from e
    from . import _fake  # noqa: F401
    from .layout import (allocate_indexer_cache, allocate_mla_cache, allocate_staging, dequantize_indexer,
                         dequantize_mla, indexer_cache_view, mla_cache_view)
    from .ops import combine, cuda_dispatch_impl, dispatch, fence, insert, rope_table, validate_slots
    from .consumers import indexer_topk, lse_merge, quantize_index_q, sparse_mla
    from .plan import DECODE_OWNERSHIPS, LOCAL_ORDERS, PcpPlan, Request, make_plan
    from .transport import choose_transport, resolve_transport
    from .tables import CacheTargets, FenceState, RowDests, allocate_fence_pads, peer_pointers, pointer_table
    from .engine_caches import EngineCaches

__version__ = "0.1.0"
