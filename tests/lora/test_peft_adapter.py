"""Reading PEFT adapters (compiled_llm/lora/peft_adapter.py): rank and scaling as PEFT computes
them, and a clear error naming the problem for everything the kernels cannot apply."""

from __future__ import annotations

import json
import math

import pytest

from compiled_llm.lora.peft_adapter import LoRAAdapterError, check_fits, load_peft_adapter
from tests.lora.adapters import ALL_TARGETS, make_adapter


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama, tmp_path_factory):
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("peft") / "a", 8, ALL_TARGETS, 0, alpha=32,
                        merged=False)[0]


def test_reads_rank_scaling_and_every_target(adapter_dir, tiny_llama):
    from transformers import AutoConfig

    adapter = load_peft_adapter(adapter_dir, max_rank=16)
    assert adapter.rank == 8 and adapter.scaling == 32 / 8
    assert adapter.target_modules == set(ALL_TARGETS)
    assert {layer for layer, _ in adapter.weights} == {0, 1}
    a, b = adapter.weights[(0, "q_proj")]
    assert tuple(a.shape) == (8, 64) and tuple(b.shape) == (64, 8) and b.abs().sum() > 0
    check_fits(adapter, AutoConfig.from_pretrained(tiny_llama))


def test_rslora_scales_by_the_root_of_the_rank(tiny_llama, tmp_path):
    path, _ = make_adapter(tiny_llama, tmp_path / "rs", 4, ["q_proj"], 1, alpha=8, merged=False, use_rslora=True)
    assert load_peft_adapter(path, 16).scaling == pytest.approx(8 / math.sqrt(4))


def test_rank_above_max_lora_rank(adapter_dir):
    with pytest.raises(LoRAAdapterError, match="rank 8 is above max_lora_rank 4"):
        load_peft_adapter(adapter_dir, max_rank=4)


@pytest.mark.parametrize(("options", "message"), [
    ({"target_modules": ["embed_tokens"]}, "target_modules \\['embed_tokens'\\] not supported"),
    ({"use_dora": True}, "use_dora not supported"),
    ({"bias": "lora_only"}, "bias not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save not supported"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
])
def test_unsupported_options_are_refused_by_name(adapter_dir, tmp_path, options, message):
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(adapter_dir, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **options}))
    with pytest.raises(LoRAAdapterError, match=message):
        load_peft_adapter(str(folder), 16)


def test_an_embedding_adapter_is_refused(tiny_llama, tmp_path):
    path, _ = make_adapter(tiny_llama, tmp_path / "emb", 4, ["embed_tokens", "q_proj"], 2, merged=False)
    with pytest.raises(LoRAAdapterError, match="not supported"):
        load_peft_adapter(path, 16)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing", "bad-json"])
def test_damaged_files(adapter_dir, tmp_path, damage):
    import shutil

    folder = tmp_path / damage
    shutil.copytree(adapter_dir, folder)
    weights = folder / "adapter_model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:200])
    elif damage == "garbage":
        weights.write_bytes(b"\x00" * 64)
    elif damage == "missing":
        weights.unlink()
    else:
        (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match=str(folder)):
        load_peft_adapter(str(folder), 16)


def test_not_a_folder(tmp_path):
    with pytest.raises(LoRAAdapterError, match="not a folder"):
        load_peft_adapter(str(tmp_path / "nowhere"), 16)


def test_an_adapter_for_another_model_does_not_fit(adapter_dir, tiny_llama):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama)
    config.intermediate_size = 256
    with pytest.raises(LoRAAdapterError, match="another model"):
        check_fits(load_peft_adapter(adapter_dir, 16), config)
