"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's spelling, its defaults, clear errors."""

from __future__ import annotations

import pytest

from compiled_llm.config import SpeculativeConfig
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.entrypoints.cli import build_parser


def test_vllm_spelling_and_defaults():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 4, 4)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 2)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.from_dict({"model": "/drafts/small", "num_speculative_tokens": 3})  # vLLM: a draft
    assert (spec.method, spec.model, spec.prompt_lookup_min) == ("draft_model", "/drafts/small", None)


@pytest.mark.parametrize("spec, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/drafts/small"}, "draft_model's fields"),
    ({"method": "draft_model", "model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "ngram's fields"),
])
def test_bad_values_name_the_field(spec, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(spec)


def test_the_flag_reaches_the_engine_config_and_keeps_async_scheduling(real_model_path):
    args = build_parser().parse_args(
        ["serve", real_model_path, "--max-model-len", "256", "--async-scheduling", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config == SpeculativeConfig("ngram", 4, 2, 3)
    assert config.scheduler_config.async_scheduling
    plain = EngineArgs(model=real_model_path, max_model_len=256).create_engine_config()
    assert plain.speculative_config is None


def test_speculation_leaves_the_compile_cache_key_alone(real_model_path):
    from compiled_llm.worker.cache_factors import engine_cache_factors

    plain = EngineArgs(model=real_model_path, max_model_len=256).create_engine_config()
    spec = EngineArgs(model=real_model_path, max_model_len=256,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 4}).create_engine_config()
    assert engine_cache_factors(plain, 0) == engine_cache_factors(spec, 0)
