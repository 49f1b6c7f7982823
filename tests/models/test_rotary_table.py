"""The rotary cos/sin table (models/layers/rotary.py) is float64 cos and sin correctly rounded to
float32, the same bits in every build: torch's own float64 cos on 2 threads once gave a fresh
process a table off in the last bit, and two builds of one model then differed."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import math, torch
torch.set_num_threads(2)
from compiled_llm.models.layers.rotary import RotaryEmbedding
table = RotaryEmbedding(16, 1024, 10000.0).cos_sin_cache  # this process's first float64 cos and sin
inv_freq = [1.0 / 10000.0 ** (i / 16) for i in range(0, 16, 2)]
angles = [p * f for p in range(1024) for f in inv_freq]
ref = torch.cat([torch.tensor([math.cos(a) for a in angles], dtype=torch.float64).view(1024, 8),
                 torch.tensor([math.sin(a) for a in angles], dtype=torch.float64).view(1024, 8)], -1).float()
print((table != ref).sum().item(), table.dtype, tuple(table.shape))
"""


def test_the_table_is_correctly_rounded_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "torch.float32", "(1024,", "16)"]
