"""The per-(slot, layer, module) rank table: its layout, what slot writes put in it, outputs
against transformers + peft for adapters whose targets and ``rank_pattern`` differ per module
(slot buffers on all seven projections), and the eager launch skip it drives.

The expected ranks come from the adapters' safetensors files themselves (each
``lora_A.weight``'s row count), not from manylora's reader.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from manylora import LLM, LoRARequest, SamplingParams
from manylora.config import LORA_TARGET_MODULES
from manylora.lora import slots as lora_slots
from manylora.lora.linear import LoRALinear
from manylora.lora.slot_table import SlotTable
from manylora.testing import compare_greedy, hf_greedy_reference, make_peft_adapter

MAX_NEW = 6
_KEY = re.compile(r"layers\.(\d+)\..*\.(\w+_proj)\.lora_A\.weight$")


def file_ranks(adapter_dir: Path) -> dict[tuple[int, str], int]:
    """``{(layer, module): rank}`` read from the adapter's safetensors file."""
    ranks = {}
    for key, t in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        m = _KEY.search(key)
        if m:
            ranks[(int(m.group(1)), m.group(2))] = t.shape[0]
    assert ranks, f"no lora_A tensors in {adapter_dir}"
    return ranks


# ---------------------------------------------------------------------------------------------
# layout


def _qkv_and_o(max_loras: int = 3) -> dict:
    """Layer 0's packed q/k/v and o_proj slots, and layer 1's o_proj slots."""
    def make(names, sizes):
        return LoRALinear(8, sizes, names, False, torch.float32,
                          torch.device("cpu")).create_lora_slots(names, max_loras, 4)

    qkv = make(("q_proj", "k_proj", "v_proj"), (8, 4, 4))
    return {(0, "q_proj"): qkv, (0, "k_proj"): qkv, (0, "v_proj"): qkv,
            (0, "o_proj"): make(("o_proj",), (8,)), (1, "o_proj"): make(("o_proj",), (8,))}


def test_columns_views_and_writes():
    """A packed projection owns consecutive columns; its ``ranks`` / ``dora`` are views of
    them; ``set_slot`` writes its entry (host mirror and device), ``write_row`` and
    ``clear`` a whole slot."""
    slots = _qkv_and_o()
    table = SlotTable(slots, 3, torch.device("cpu"))
    assert table.keys == ((0, "q_proj"), (0, "k_proj"), (0, "v_proj"), (0, "o_proj"),
                          (1, "o_proj"))
    assert [table.column(0, "v_proj"), table.column(1, "o_proj")] == [2, 4]
    qkv = slots[(0, "k_proj")]
    assert qkv.table is table and qkv.rank_col == 0 and qkv.ranks.shape == (3, 3)
    assert qkv.ranks.untyped_storage().data_ptr() == table.ranks.untyped_storage().data_ptr()
    qkv.set_slot(2, "k_proj", torch.ones(3, 8), torch.ones(4, 3), torch.ones(4))
    slots[(1, "o_proj")].set_slot(2, "o_proj", torch.ones(2, 8), torch.ones(8, 2))
    assert table.ranks.tolist()[2] == [0, 3, 0, 0, 2]
    assert table.dora.tolist()[2] == [0, 1, 0, 0, 0]
    assert table.ranks_host.tolist() == table.ranks.tolist()
    assert table.dora_host.tolist() == table.dora.tolist()
    assert qkv.ranks.tolist()[2] == [0, 3, 0]
    qkv.set_slot(2, "k_proj", None, None)                  # an adapter without k: rank 0
    assert table.ranks.tolist()[2] == [0, 0, 0, 0, 2] and not table.dora.any()
    table.write_row(1, np.array([1, 2, 3, 4, 5]), np.array([0, 0, 7, 0, 0]))
    assert table.ranks.tolist()[1] == [1, 2, 3, 4, 5]
    assert table.dora_host.tolist()[1] == [0, 0, 1, 0, 0]
    table.clear(1)
    assert not table.ranks[1].any() and not table.ranks_host[1].any()


def test_bad_tables_and_writes_raise():
    slots = _qkv_and_o()
    table = SlotTable(slots, 3, torch.device("cpu"))
    with pytest.raises(KeyError, match="gate_proj"):
        table.column(0, "gate_proj")
    with pytest.raises(ValueError, match="5 columns"):
        table.write_row(0, np.zeros(4), np.zeros(4))
    with pytest.raises(ValueError, match="negative"):
        table.write_row(0, np.full(5, -1), np.zeros(5))
    with pytest.raises(ValueError, match="rank -1"):
        table.set(0, 0, -1, False)
    with pytest.raises(ValueError, match="slots, the table"):
        SlotTable(slots, 4, torch.device("cpu"))
    qkv = slots[(0, "q_proj")]
    with pytest.raises(ValueError, match="layers 0 and 1"):
        SlotTable({(0, "q_proj"): qkv, (1, "k_proj"): qkv}, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="maps to slots"):
        SlotTable({(0, "o_proj"): qkv}, 3, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# the engine: ranks per (layer, module), outputs vs peft, eager launch skip


@pytest.fixture(scope="module")
def adapters(demo_set, tmp_path_factory):
    """The demo set's four adapters (q/v only; all seven; o/down/gate/up of layer 1 only;
    q/k/v/o with ``rank_pattern`` o=8) plus one on all seven projections whose ranks differ
    per module (``rank_pattern``) and one on k_proj only."""
    root = tmp_path_factory.mktemp("rank_table")
    out = dict(demo_set.adapters)
    out["pattern"] = make_peft_adapter(
        demo_set.base_dir, root / "pattern", r=12, lora_alpha=24,
        target_modules=list(LORA_TARGET_MODULES), seed=11,
        rank_pattern={"q_proj": 4, "k_proj": 2, "down_proj": 6, "up_proj": 1})
    out["k_only"] = make_peft_adapter(demo_set.base_dir, root / "k_only", r=8, lora_alpha=8,
                                      target_modules=["k_proj"], seed=12)
    return {name: Path(path) for name, path in out.items()}


def _requests(adapters, names):
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    return [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]


def _prompts(llm, n: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    texts = ["Low-rank adaptation of", "SELECT name FROM", "The quick brown fox jumps",
             "def add(a, b):", "Once upon", "Paged attention splits the cache into",
             "Hello", "x"]
    return [tok(t).input_ids for t in texts[:n]]


def test_per_module_ranks_and_outputs_match_peft(demo_set, adapters):
    """Six adapters of different target sets, layers and rank_patterns in one mixed batch
    with slot buffers on all seven projections: tokens equal transformers + peft, and each
    slot's table row holds the file's rank of every (layer, module) it targets and 0 for
    every other (layer, module)."""
    names = ["pattern", "sql", None, "k_only", "math", "code", "chat", "pattern"]
    llm = LLM(str(demo_set.base_dir), device="cpu", max_loras=len(adapters), max_lora_rank=32,
              num_kv_blocks=256, block_size=4, max_num_batched_tokens=40)
    prompts = _prompts(llm, len(names))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                        lora_request=_requests(adapters, names), use_tqdm=False)
    refs = hf_greedy_reference(demo_set.base_dir, adapters, prompts, names, MAX_NEW)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        ok, pos = compare_greedy(out.outputs[0].token_ids, ref)
        assert ok, f"prompt {i} ({names[i]}): diverges at token {pos}"

    core = llm.llm_engine.engine_core
    table = core.executor.model.slot_table
    assert set(table.keys) == {(layer, m) for layer in range(2) for m in LORA_TARGET_MODULES}
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    seen = set()
    for slot, lid in enumerate(core.lora_manager.slot_to_id):
        if lid is None:
            continue
        name = next(n for n, i in ids.items() if i == lid)
        want = file_ranks(adapters[name])
        got = {key: int(table.ranks_host[slot, table.column(*key)]) for key in table.keys}
        assert got == {key: want.get(key, 0) for key in table.keys}, name
        assert table.ranks[slot].tolist() == table.ranks_host[slot].tolist()
        assert not table.dora_host[slot].any()
        seen.add(name)
    assert {"pattern", "k_only", "math", "code"} <= seen
    assert file_ranks(adapters["pattern"])[(0, "up_proj")] == 1      # the pattern took effect


def test_eager_steps_launch_only_the_projections_their_slots_target(demo_set, adapters,
                                                                    monkeypatch):
    """The same one-request generation under three adapters, counting the shrink and expand
    calls (by the projection's slices): q/v only (``sql``) launches for ``qkv_proj`` alone,
    o/down/gate/up of layer 1 only (``code``) for three projections of one layer, all seven
    (``chat``) for the four projections of both layers, in as many steps."""
    calls: list[tuple[str, tuple[str, ...]]] = []
    real_shrink, real_expand = lora_slots.LoRASlots.shrink, lora_slots.LoRASlots.expand

    def shrink(self, x, mapping):
        calls.append(("shrink", self.module_names))
        return real_shrink(self, x, mapping)

    def expand(self, y, buffer, mapping):
        calls.append(("expand", self.module_names))
        real_expand(self, y, buffer, mapping)

    monkeypatch.setattr(lora_slots.LoRASlots, "shrink", shrink)
    monkeypatch.setattr(lora_slots.LoRASlots, "expand", expand)
    llm = LLM(str(demo_set.base_dir), device="cpu", max_loras=2, max_lora_rank=32,
              num_kv_blocks=64, block_size=4)
    prompt = _prompts(llm, 1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    counts = {}
    for name in ("sql", "code", "chat"):
        calls.clear()
        llm.generate([{"prompt_token_ids": p} for p in prompt], params,
                     lora_request=_requests(adapters, [name]), use_tqdm=False)
        counts[name] = list(calls)
    steps = 4                                   # one prefill, three decodes
    qkv = ("q_proj", "k_proj", "v_proj")
    assert counts["sql"] == [("shrink", qkv), ("expand", qkv)] * 2 * steps   # 2 layers
    assert sorted(set(n for _, n in counts["code"])) == [("down_proj",), ("gate_proj",
                                                         "up_proj"), ("o_proj",)]
    assert len(counts["code"]) == 2 * 3 * steps                               # layer 1 only
    assert len(counts["chat"]) == 2 * 4 * 2 * steps
