"""Runnable examples: ``python -m pcpkv_torch.examples.prefill --help``."""
