"""``manylora serve --model x.gguf``: the chat route renders with the GGUF's own chat template.

Reference: transformers' tokenizer (its ``chat_template`` read from the GGUF) and float32
model of the same file (``gguf_file=``), greedy.
"""

from __future__ import annotations

import openai
import torch
from server_helpers import BASE, running_server

QUESTION = "What is the capital of France?"


def test_server_chat_uses_gguf_chat_template(smollm2_gguf, smollm2_hf_model, smollm2_tokenizer):
    messages = [{"role": "user", "content": QUESTION}]
    text = smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
    assert "<|im_start|>assistant" in text                   # SmolLM2's ChatML template
    ids = smollm2_tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = smollm2_hf_model.generate(ids, do_sample=False, max_new_tokens=12,
                                        pad_token_id=smollm2_tokenizer.eos_token_id)
    expected = smollm2_tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    with running_server(smollm2_gguf, max_model_len=512, block_size=16, num_kv_blocks=64,
                        max_num_seqs=4) as (_, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
        reply = client.chat.completions.create(model=BASE, messages=messages, temperature=0,
                                               max_tokens=12)
    assert reply.usage.prompt_tokens == ids.shape[1]
    assert reply.choices[0].message.content == expected
    assert "Paris" in expected
