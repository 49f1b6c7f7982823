"""Attention and KV-cache kernels: torch for CPUs (and as the reference), Triton for GPUs.

Installed as `compiled_llm.kernels`. Kept free of imports: a checkout on `sys.path` also makes
this folder importable as a top-level `kernels`, a name other libraries probe for.
"""
