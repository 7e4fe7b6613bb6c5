"""Decode graphs keyed by projection mask: the policy (admission, subset fallback, LRU
bound), the masks the rank table yields, the CPU run of the masked graph path against
transformers + peft (graphs replaced by their forward functions, so every step takes the
graph code path: mask in the layout, key selection, a padded mapping with the mask's
columns), and on a GPU the masked graphs against eager execution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.lora import slots as lora_slots
from manylora.lora.linear import LoRALinear
from manylora.lora.slot_table import SlotTable
from manylora.testing import compare_greedy, hf_greedy_reference
from manylora.worker.cuda_graph import DecodeGraphs
from manylora.worker.graph_masks import AGING, GraphMaskPolicy
from manylora.worker.step_codec import decode_step, encode_step

FULL = 0b1111111                       # seven kinds (any kinds: the policy sees bits)


# ---------------------------------------------------------------------------------------------
# policy


def test_a_mask_is_admitted_after_min_uses_and_then_replayed():
    policy = GraphMaskPolicy(FULL, max_masks=2, min_uses=2)
    assert policy.choose(0b1111) == (FULL, ())            # first ask: the all-kinds graph
    assert policy.choose(0b1111) == (0b1111, ())          # second: admitted
    assert policy.choose(0b1111) == (0b1111, ())
    assert policy.held == (0b1111,)
    assert policy.choose(-1) == (FULL, ()) and policy.choose(FULL) == (FULL, ())
    assert policy.held == (0b1111,)                       # full never takes a place


def test_unheld_masks_replay_the_smallest_held_superset():
    policy = GraphMaskPolicy(FULL, max_masks=3, min_uses=3)
    for mask in (0b0111111, 0b0001111):
        for _ in range(3):
            policy.choose(mask)
    assert policy.choose(0b0000101) == (0b0001111, ())    # fewest kinds among supersets
    assert policy.choose(0b0010000) == (0b0111111, ())
    assert policy.choose(0b1000000) == (FULL, ())         # no held superset
    for mask in (0b0000101, 0b0010000, 0b1000000):        # each a subset of what it ran
        run, _ = policy.choose(mask)
        assert run & mask == mask


def test_bound_evicts_the_lru_mask_for_a_more_used_one():
    """With every place taken, a new mask evicts the least recently used one only once it
    was asked for more often (TinyLFU admission): masks taking turns do not capture at
    every step."""
    policy = GraphMaskPolicy(FULL, max_masks=2, min_uses=1)
    assert policy.choose(0b1) == (0b1, ())
    assert policy.choose(0b10) == (0b10, ())
    assert policy.choose(0b1) == (0b1, ())                # 0b10 (1 use) is now the oldest
    assert policy.choose(0b100) == (FULL, ())             # 1 use, not more than 0b10's
    assert policy.choose(0b100) == (0b100, (0b10,))       # 2 uses: admitted, 0b10 evicted
    assert policy.held == (0b1, 0b100)
    for _ in range(3):                                    # four masks in turn, two places
        captures = 0
        for mask in (0b1000, 0b10000, 0b1, 0b100):
            run, evicted = policy.choose(mask)
            captures += bool(evicted)
            assert run & mask == mask
        assert captures <= 1
    assert GraphMaskPolicy(FULL, max_masks=0).choose(0b1) == (FULL, ())   # masks off


def test_use_counts_age():
    """Counts halve every ``AGING`` asks: a mask once popular is displaced by one asked for
    more often than its halved count (without aging it would take ``AGING`` asks)."""
    policy = GraphMaskPolicy(FULL, max_masks=1, min_uses=1)
    for _ in range(AGING - 1):
        policy.choose(0b1)                        # 4095 uses
    policy.choose(0b10)                           # the AGING-th ask: 0b1 → 2047, 0b10 → 0
    for _ in range(AGING // 2 - 1):
        assert policy.choose(0b10) == (FULL, ())  # up to 2047 uses: not more than 0b1's
    assert policy.held == (0b1,)
    assert policy.choose(0b10) == (0b10, (0b1,))  # 2048 > 2047


def test_policy_rejects_bad_input():
    with pytest.raises(ValueError, match="outside"):
        GraphMaskPolicy(FULL).choose(1 << 7)
    with pytest.raises(ValueError, match="min_uses"):
        GraphMaskPolicy(FULL, min_uses=0)


def test_decode_graphs_select_keys():
    """No-LoRA steps ignore the mask; LoRA steps get the policy's choice; the same sequence
    of masks gives the same keys on every (tensor-parallel) rank."""
    runs = []
    for _ in range(2):
        graphs = DecodeGraphs((1, 4), FULL, max_masks=1, min_uses=2)
        runs.append([graphs.select(4, None, 0b1), graphs.select(4, "bgmv", 0b11),
                     graphs.select(1, "tiled", 0b11), graphs.select(4, "bgmv", 0b1),
                     graphs.select(4, "bgmv", -1)])
    assert runs[0] == runs[1] == [(4, None, FULL), (4, "bgmv", FULL), (1, "tiled", 0b11),
                                  (4, "bgmv", 0b11), (4, "bgmv", FULL)]


def test_the_mask_travels_with_the_step():
    """``StepLayout.lora_mask`` survives the tensor-parallel step codec."""
    from manylora.worker.step_inputs import StepInputs, StepLayout
    layout = StepLayout(4, 4, 4, 4, 1, 1, 4, 0, 4, 1, 4, 4, lora_mask=0b1001)
    back = decode_step(encode_step(StepInputs(layout, np.arange(8, dtype=np.int32))))
    assert back.layout == layout and back.layout.lora_mask == 0b1001


# ---------------------------------------------------------------------------------------------
# the rank table's masks


def _slots(max_loras: int = 3) -> dict:
    """Two layers of packed q/k/v and o_proj slots."""
    def make(names, sizes):
        return LoRALinear(8, sizes, names, False, torch.float32,
                          torch.device("cpu")).create_lora_slots(names, max_loras, 4)

    out = {}
    for layer in range(2):
        qkv = make(("q_proj", "k_proj", "v_proj"), (8, 4, 4))
        out.update({(layer, m): qkv for m in qkv.module_names})
        out[(layer, "o_proj")] = make(("o_proj",), (8,))
    return out


def test_kind_mask_is_the_union_over_slots_and_layers():
    """A kind is one launch (a packed projection); the mask ORs the step's slots over
    every layer, from the host mirror."""
    table = SlotTable(_slots(), 3, torch.device("cpu"))
    assert table.kinds == (("q_proj", "k_proj", "v_proj"), ("o_proj",))
    assert table.full_mask == 0b11
    table.set(0, table.column(1, "v_proj"), 4, False)          # slot 0: v of layer 1
    table.set(2, table.column(0, "o_proj"), 2, False)          # slot 2: o of layer 0
    table.set(1, table.column(0, "q_proj"), 3, False)          # slot 1: not in the step
    assert table.kind_mask(np.array([0, -1, -1])) == 0b01
    assert table.kind_mask(np.array([2, -1, -1])) == 0b10
    assert table.kind_mask(np.array([0, 2, -1])) == 0b11
    assert table.kind_mask(np.array([-1, -1, -1])) == 0
    table.clear(2)
    assert table.kind_mask(np.array([0, 2, -1])) == 0b01
    assert table.mask_columns(0b10) == (False, False, False, True) * 2
    assert table.mask_columns(0b01) == (True, True, True, False) * 2
    with pytest.raises(ValueError, match="outside"):
        table.mask_columns(0b100)


# ---------------------------------------------------------------------------------------------
# the masked graph path on the CPU


class EagerGraphs(DecodeGraphs):
    """``DecodeGraphs`` whose graphs are their forward functions, run at each replay: on the
    CPU every decode step goes through the graph path (mask, key, padded mapping)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replaying: tuple | None = None
        self.replayed: list[tuple] = []

    def capture(self, key, forward) -> None:
        self._graphs[key] = (forward, None)

    def replay(self, key):
        forward, _ = self._graphs[key]
        self.replaying = key
        self.replayed.append(key)
        try:
            return forward()
        finally:
            self.replaying = None


def test_masked_graph_steps_match_peft_and_launch_only_their_kinds(demo_set, monkeypatch):
    """Decode steps through the graph path with slot buffers on all seven projections:
    ``sql`` (q/v) twice, ``code`` (o/gate/up/down of layer 1), ``sql`` with ``math``
    (q/k/v/o, ``rank_pattern``) and a base row, and ``chat`` (all seven) with ``sql``.
    Tokens equal transformers + peft; once a mask is admitted its steps replay its graph,
    which launches the shrink of its kinds' projections only."""
    calls: list[tuple] = []
    real_shrink = lora_slots.LoRASlots.shrink

    def shrink(self, x, mapping):
        calls.append((graphs.replaying, self.module_names))
        return real_shrink(self, x, mapping)

    monkeypatch.setattr(lora_slots.LoRASlots, "shrink", shrink)
    ids = {name: i + 1 for i, name in enumerate(demo_set.adapters)}
    llm = LLM(str(demo_set.base_dir), device="cpu", max_loras=4, max_lora_rank=32,
              num_kv_blocks=256, block_size=4)
    runner = llm.llm_engine.engine_core.executor.runner
    table = runner.model.slot_table
    graphs = EagerGraphs((1, 2, 4, 8), table.full_mask, max_masks=4, min_uses=2)
    runner.graphs = graphs
    tok = llm.get_tokenizer()
    texts = ["Low-rank adaptation of", "SELECT name FROM", "The quick brown fox",
             "def add(a, b):"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kinds = table.kinds
    assert kinds == (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                     ("down_proj",))
    bits = {"sql": 0b0001, "math": 0b0011, "code": 0b1110, "chat": 0b1111}
    for names in (["sql", "sql"], ["code"], ["sql", "math", None], ["chat", "sql"]):
        prompts = [tok(t).input_ids for t in texts[:len(names)]]
        loras = [None if n is None else LoRARequest(n, ids[n], str(demo_set.adapters[n]))
                 for n in names]
        for lora in loras:        # read before the batch: every request joins the first step
            if lora is not None:
                llm.llm_engine.add_lora(lora)
        calls.clear()
        graphs.replayed.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=loras, use_tqdm=False)
        refs = hf_greedy_reference(demo_set.base_dir, demo_set.adapters, prompts, names, 6)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            ok, pos = compare_greedy(out.outputs[0].token_ids, ref)
            assert ok, f"{names}: prompt {i} ({names[i]}) diverges at token {pos}"
        want = 0
        for n in names:
            want |= bits.get(n, 0)
        lora_keys = [k for k in graphs.replayed if k[1] is not None]
        assert len(lora_keys) == 5, names                       # five decode steps
        assert {k[2] for k in lora_keys[1:]} == {want}, (names, lora_keys)
        launched = {names_of for key, names_of in calls if key is not None and key[2] == want}
        expect = {kind for k, kind in enumerate(kinds) if want >> k & 1}
        assert launched == expect, (names, launched)


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
def test_masked_graphs_equal_eager_on_gpu(demo_set):
    """On a GPU, real captured graphs for the masks of q/v-only, layer-1-MLP-only and mixed
    batches give the eager path's tokens (float32, bit for bit), and masked graphs were
    captured and replayed."""
    names = ["sql", "sql", "code", "sql", "code", None, "math", "sql"]
    ids = {name: i + 1 for i, name in enumerate(demo_set.adapters)}
    loras = [None if n is None else LoRARequest(n, ids[n], str(demo_set.adapters[n]))
             for n in names]
    prompts = [{"prompt_token_ids": list(range(3 + i, 10 + 2 * i))} for i in range(len(names))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(demo_set.base_dir), device="cuda", dtype="float32", max_loras=4,
                  max_lora_rank=32, max_num_seqs=8, enforce_eager=eager)
        got = []
        for group in (slice(0, 2), slice(2, 3), slice(0, 5), slice(0, 8)):
            got += [o.outputs[0].token_ids for o in
                    llm.generate(prompts[group], params, loras[group], use_tqdm=False)]
        outs[eager] = got
        if not eager:
            graphs = llm.llm_engine.engine_core.executor.runner.graphs
            masks = {k[2] for k in graphs.keys if k[1] is not None}
            assert len(masks) > 1, "no masked graph was captured"
            assert graphs.serving_captures > 0
        del llm
    assert outs[False] == outs[True]
