"""The compiler's graph passes: which exist, which a config turns on, and their part of the cache key.

Passes rewrite the traced graph before it is split around the attention ops (so a fusion may
reach across a piece's edge into a splitting op), in the order listed here. Each pass is a
callable object with a `name` that rewrites an `fx.Graph` in place and returns how many sites it
fused; a pass that finds nothing to fuse changes nothing. The enabled passes and the source of
every pass join the compile-cache key, so changing either never reuses stale artifacts.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Callable, Protocol

import torch.fx as fx

from compiled_llm.compilation.rotary_attention_fusion import RotaryAttentionFusion
from compiled_llm.compilation.silu_mul_linear_fusion import SiluMulLinearFusion
from compiled_llm.logger import init_logger

logger = init_logger(__name__)


class GraphPass(Protocol):
    name: str

    def __call__(self, graph: fx.Graph) -> int: ...


# name -> factory, in the order the passes run.
PASSES: dict[str, Callable[[], GraphPass]] = {
    RotaryAttentionFusion.name: RotaryAttentionFusion,
    SiluMulLinearFusion.name: SiluMulLinearFusion,
}
DEFAULT_PASSES = tuple(PASSES)


def check_pass_names(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown compiler pass(es) {unknown}; known: {list(PASSES)}.")
    return [n for n in PASSES if n in names]  # the fixed order, no duplicates


class PassManager:
    def __init__(self, names: list[str]) -> None:
        self.passes = [PASSES[n]() for n in check_pass_names(names)]

    def __call__(self, gm: fx.GraphModule) -> dict[str, int]:
        """Run every enabled pass over `gm`; returns the sites each one fused."""
        fused = {p.name: p(gm.graph) for p in self.passes}
        if any(fused.values()):
            gm.graph.lint()
            gm.recompile()
        logger.info("Compiler passes: %s.", ", ".join(f"{n} fused {k}" for n, k in fused.items()) or "none enabled")
        return fused

    def uuid(self) -> str:
        """Identifies the enabled passes and their code (each pass's whole module), for the
        compile-cache key."""
        h = hashlib.sha256()
        for p in self.passes:
            h.update(p.name.encode())
            h.update(inspect.getsource(inspect.getmodule(type(p))).encode())
        return h.hexdigest()[:16]
