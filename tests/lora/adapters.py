"""PEFT adapters made in the tests: random weights (B too: PEFT initialises it to zero, which would
hide a dropped update) on a model folder, saved with PEFT, and the same adapter merged into a copy
of the model for HF transformers to run as the oracle."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, out: Path, rank: int, targets: list[str], seed: int, alpha: float | None = None,
                 std: float = 0.1, merged: bool = True, **options) -> tuple[str, str | None]:
    """Save a random adapter for the model at `base` into `out`; returns its folder and, with
    `merged`, a folder holding the base model with the adapter merged in."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
                        **options)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    peft_model.save_pretrained(out)
    if not merged:
        return str(out), None
    merged_dir = out.parent / f"{out.name}-merged"
    peft_model.merge_and_unload().save_pretrained(merged_dir)
    return str(out), str(merged_dir)
