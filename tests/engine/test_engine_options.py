"""Engine options benchmarks and token-id clients rely on: random weights (load_format="dummy")
and no tokenizer (skip_tokenizer_init), as in vLLM."""

from __future__ import annotations

import shutil

import pytest

from manylora import LLM, LoRARequest, SamplingParams


@pytest.fixture(scope="module")
def config_only(demo_set, tmp_path_factory):
    """The demo base's config.json alone: no weights, no tokenizer."""
    d = tmp_path_factory.mktemp("config_only")
    shutil.copy(demo_set.base_dir / "config.json", d / "config.json")
    return d


def test_dummy_weights_serve_token_ids_without_tokenizer(config_only, demo_set):
    llm = LLM(str(config_only), load_format="dummy", skip_tokenizer_init=True, max_loras=2)
    assert llm.get_tokenizer() is None
    sql = LoRARequest("sql", 1, str(demo_set.adapters["sql"]))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, params, [None, sql],
                        use_tqdm=False)
    for out in outs:
        assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
        assert out.outputs[0].finish_reason == "length"
    weights = [p for p in llm.llm_engine.engine_core.executor.model.parameters()]
    assert all(0 < float(p.abs().max()) <= 1e-3 for p in weights)


def test_without_tokenizer_text_prompts_and_stop_strings_are_refused(config_only):
    llm = LLM(str(config_only), load_format="dummy", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop=["x"]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_unknown_load_format(config_only):
    with pytest.raises(ValueError, match="unknown load_format 'pt'"):
        LLM(str(config_only), load_format="pt", skip_tokenizer_init=True)
