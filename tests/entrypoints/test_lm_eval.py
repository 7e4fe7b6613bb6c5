"""lm-evaluation-harness's ``local-completions`` model against a real ``manylora serve``:
a multiple-choice (loglikelihood) task from a local dataset (a task YAML and a jsonl in
``tmp_path``, no hub), run to completion against an adapter and the base, with the
tokenizer given (``tokenizer=`` the checkpoint dir) and without it (lm-eval then uses the
server's ``/tokenizer_info`` and ``/tokenize``).

Reference: transformers (+ peft for the adapter) on the same float32 weights, teacher
forced: each choice's loglikelihood is the sum of ``log_softmax`` over its tokens given the
context, with the context/continuation split lm-eval makes (encode the whole, cut at the
context's length). lm-eval's per-sample results (``log_samples``) must equal it within 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch
from server_helpers import BASE

lm_eval = pytest.importorskip("lm_eval")

TOL = 1e-4
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "a cat"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "answer": 0},
    {"question": "SELECT name FROM users", "choices": ["WHERE id = 1", "ORDER BY name",
                                                       "LIMIT 5"], "answer": 1},
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_task")
    data = d / "mc.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (d / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    return d


@pytest.fixture(scope="module")
def reference(base_dir, adapters):
    """``(model name, context, continuation) -> loglikelihood`` (float64 sum)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))
    models = {}

    @torch.no_grad()
    def run(name, context, continuation):
        if name not in models:
            m = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
            models[name] = m if name == BASE else PeftModel.from_pretrained(
                m, str(adapters[name])).eval()
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        ctx = len(tok(context, add_special_tokens=False).input_ids)
        x = torch.tensor([whole])
        lp = models[name](input_ids=x).logits[0].double().log_softmax(-1)
        return sum(float(lp[j - 1, whole[j]]) for j in range(ctx, len(whole)))

    return run


@pytest.mark.parametrize("model, with_tokenizer", [("ad1", True), (BASE, True),
                                                   ("ad1", False)])
def test_lm_eval_multiple_choice_matches_peft(served, base_dir, task_dir, reference,
                                              monkeypatch, model, with_tokenizer):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = {"base_url": f"{served[1]}/v1/completions", "model": model, "num_concurrent": 2,
            "max_retries": 1, "tokenized_requests": True}
    if with_tokenizer:
        args.update(tokenizer=str(base_dir), tokenizer_backend="huggingface")
    lm = LocalCompletionsAPI(**args)
    if not with_tokenizer:       # found /tokenizer_info and /tokenize: the server's tokenizer
        assert lm.tokenizer_backend == "remote"
        hf = AutoTokenizer.from_pretrained(str(base_dir))
        assert lm.tokenizer.eos_token_id == hf.eos_token_id
        assert lm.tok_encode(" Paris is") == hf(" Paris is", add_special_tokens=False).input_ids
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True, bootstrap_iters=0)
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == len(DOCS)
    assert "acc,none" in results["results"]["tiny_mc"]
    for sample in samples:
        doc = sample["doc"]
        got = [float(ll) for ll, _ in sample["filtered_resps"]]
        want = [reference(model, doc["question"], " " + c) for c in doc["choices"]]
        assert got == pytest.approx(want, abs=TOL)
