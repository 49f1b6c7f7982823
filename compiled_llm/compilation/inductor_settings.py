"""Process-wide Inductor settings that keep warm starts fast and cache entries self-sufficient.

- `cpp.vec_isa_ok = True`: Inductor otherwise probes each CPU vector ISA in a fresh Python
  subprocess at the first load of every process (~2 s here). The CPU's own feature flags are
  still checked, so only ISAs the CPU has are used.
- `cpp_cache_precompile_headers = False`: a precompiled header lives in a temp folder outside
  the cache entry and is fingerprinted on every start (~1 s); without it, an entry restored on a
  fresh machine needs no C++ compilation at all.

They are applied before the cache key hashes Inductor's configuration.
"""

from __future__ import annotations


def apply() -> None:
    import torch._inductor.config as inductor_config

    inductor_config.cpp.vec_isa_ok = True
    inductor_config.cpp_cache_precompile_headers = False
