"""lm-eval-harness scores a small local multiple-choice task through the server
(`local-completions`: echo, logprobs and max_tokens 1, as it asks any OpenAI-compatible server)
and with its own `hf` model on the same weights, in the same run: same accuracy, and each
choice's log-likelihood close."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
yaml = pytest.importorskip("yaml")

TASK_DIR = Path(__file__).parent / "lm_eval_task"


def task_config() -> dict:
    config = yaml.safe_load((TASK_DIR / "multiple_choice.yaml").read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(TASK_DIR / "questions.jsonl")
    return config


def evaluate(model: str, model_args: dict) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task_config()], log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def loglikelihoods(results: dict) -> list[list[float]]:
    samples = sorted(results["samples"]["compiled_llm_mc"], key=lambda s: s["doc_id"])
    return [[resp[0] for resp in sample["filtered_resps"]] for sample in samples]


def test_lm_eval_through_the_server_matches_hf(api_server, real_model_path, monkeypatch):
    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(offline, "1")  # nothing from a hub: the dataset and model are local
    monkeypatch.setenv("OPENAI_API_KEY", os.environ.get("OPENAI_API_KEY", "unused"))
    served = evaluate("local-completions", {
        "model": "smol", "base_url": f"{api_server.url}/v1/completions", "tokenizer": real_model_path,
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "batch_size": 8, "max_retries": 1,
        "timeout": 600,
    })
    hf = evaluate("hf", {"pretrained": real_model_path, "dtype": "float32", "batch_size": 8, "device": "cpu"})
    ours, theirs = served["results"]["compiled_llm_mc"], hf["results"]["compiled_llm_mc"]
    assert ours["acc,none"] == theirs["acc,none"], (ours, theirs)
    assert 0.25 < ours["acc,none"] <= 1.0  # better than chance: the scores mean something
    for question, (a, b) in enumerate(zip(loglikelihoods(served), loglikelihoods(hf))):
        assert a == pytest.approx(b, abs=0.05), question
