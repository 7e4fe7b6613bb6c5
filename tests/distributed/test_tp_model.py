"""Tensor-parallel ranks of the LLaMA model against the one-rank model, on CPU over gloo.

Every rank runs in a spawned process (rank 0 too) and saves what it computed; the test
process computes the same on one rank and compares:

* each rank's parameters, checkpoint-loaded and dummy, are exactly the expected slices of
  the one-rank model's (slices written out here by head and row arithmetic, not through
  the loader's ``TPSlice``): column-parallel q/k/v (one replicated KV head per rank when
  there are fewer KV heads than ranks) and gate/up, row-parallel o/down, vocabulary rows
  of the embedding and LM head (zero-padded when the vocabulary does not split evenly);
* a prefill of four sequences and one decode step after it give the one-rank logits within
  float32 tolerance: without adapters, with two plain adapters mixed with base rows, with
  a DoRA adapter in the mix, and with ``fully_sharded_loras``.

Configurations: GQA (4 heads, 2 KV heads) at 2 and 4 ranks (4: KV heads replicated),
MQA with attention and MLP biases and tied embeddings at 2 ranks (KV head replicated,
row-parallel biases, DoRA shifts), Qwen2 (q/k/v biases) with a vocabulary of 509 at
2 and 4 ranks (padded vocabulary shards), and SmolLM2's 9 query / 3 KV heads at 2 ranks
(uneven heads: rank 0 holds two KV-head groups, rank 1 one).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from manylora.config import LORA_TARGET_MODULES, LoRAConfig, ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.lora.formats.loader import load_adapter_dir
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.kernels.meta import build_lora_kernel_meta
from manylora.lora_request import LoRARequest
from manylora.model.loader import load_model
from manylora.ops.attention_metadata import build_attention_metadata
from manylora.testing import make_checkpoint, make_peft_adapter
from manylora.worker.kv_cache import allocate_kv_caches

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)
# name -> (make_checkpoint arguments, vocabulary to cut the checkpoint to or None)
CASES = {
    "llama_gqa": (dict(arch="llama", num_key_value_heads=2), None),
    "llama_mqa_bias": (dict(arch="llama", num_key_value_heads=1, attention_bias=True,
                            mlp_bias=True, tie_word_embeddings=True), None),
    "qwen2_vocab509": (dict(arch="qwen2", num_key_value_heads=2), 509),
    "llama_uneven": (dict(arch="llama", hidden_size=144, num_attention_heads=9,
                          num_key_value_heads=3), None),
}
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=list(LORA_TARGET_MODULES), seed=1),
    "qvd": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=2),
    "dora": dict(r=8, lora_alpha=16, target_modules=list(LORA_TARGET_MODULES), use_dora=True,
                 seed=3),
}
MAX_LORA_RANK = 8
BLOCK = 4
LENS = [5, 9, 3, 7]
# per scenario: (fully sharded slots, slot of each sequence; None: no LoRA mapping at all)
SCENARIOS = {
    "base": (False, None),
    "lora": (False, [0, -1, 1, 0]),
    "dora": (False, [2, 0, -1, 2]),
    "fully_sharded": (True, [2, 0, -1, 1]),
}
ATOL = 1e-4


# ------------------------------------------------------------------ shared by both sides

def _prompts(vocab: int) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in LENS]
    return prompts, torch.randint(4, vocab, (len(LENS),), generator=gen).tolist()


def _two_steps(model, slot_of_seq, device) -> torch.Tensor:
    """Prefill ``LENS`` tokens per sequence, then decode one more; logits of every row of
    both steps, float32 ``[sum(LENS) + len(LENS), vocab]`` on the CPU. The mappings carry
    ``used_columns`` from the rank's own table: every rank must skip the same projections
    (their collectives included)."""
    cfg = model.cfg
    prompts, next_ids = _prompts(cfg.vocab_size)
    tables, first = [], 0
    for n in LENS:
        blocks = -(-(n + 1) // BLOCK)
        tables.append(list(range(first, first + blocks)))
        first += blocks
    kv = allocate_kv_caches(model.cfg, first, BLOCK, device)
    group = cfg.num_heads // cfg.num_kv_heads
    outs = []
    steps = [([p for p in prompts], [0] * len(LENS)), ([[t] for t in next_ids], LENS)]
    for new, done in steps:
        ids = [t for seq in new for t in seq]
        pos = [d + j for seq, d in zip(new, done) for j in range(len(seq))]
        attn = build_attention_metadata([len(s) for s in new],
                                        [d + len(s) for s, d in zip(new, done)], tables,
                                        BLOCK, group, device)
        lora = None
        if slot_of_seq is not None:
            tokens = [slot for seq, slot in zip(new, slot_of_seq) for _ in seq]
            table = model.slot_table
            lora = build_lora_kernel_meta(tokens, table.max_loras, device,
                                          ranks_host=table.ranks_host)
        hidden = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), kv,
                       attn, lora)
        outs.append(model.compute_logits(hidden).cpu())
    return torch.cat(outs)


def _run(model_dir: str, adapter_dirs: dict[str, str], tp: TPGroup,
         device: torch.device) -> dict[str, torch.Tensor]:
    """Everything one rank (or the one-rank model) computes, on the CPU: parameters, dummy
    parameters, and the logits of each scenario."""
    torch.manual_seed(0)
    full_cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir), torch.float32)
    out = {f"dummy.{k}": v.detach().cpu().clone() for k, v in load_model(
        Path(model_dir), full_cfg, device, load_format="dummy", tp=tp).named_parameters()}
    model = load_model(Path(model_dir), full_cfg, device, tp=tp)
    out.update({f"param.{k}": v.detach().cpu().clone() for k, v in model.named_parameters()})
    target = AdapterTarget(full_cfg.module_shapes(), full_cfg.num_layers, MAX_LORA_RANK,
                           LORA_TARGET_MODULES, full_cfg.dtype, dora_norm=model.lora_dora_norm)
    adapters = [load_adapter_dir(LoRARequest(name, i + 1, path), path, target)
                for i, (name, path) in enumerate(adapter_dirs.items())]
    for name, (fully_sharded, slot_of_seq) in SCENARIOS.items():
        cfg = LoRAConfig(max_loras=len(adapters), max_lora_rank=MAX_LORA_RANK,
                         fully_sharded_loras=fully_sharded)
        slots = model.create_lora_slots(cfg)
        for slot, adapter in enumerate(adapters):          # as LoRAManager._write_slot does
            for (layer, module), lora in slots.items():
                w = adapter.weights.get((layer, module))
                if w is None:
                    lora.set_slot(slot, module, None, None)
                else:
                    lora.set_slot(slot, module, w.a, w.b, w.dora_scale)
        with torch.inference_mode():
            out[f"logits.{name}"] = _two_steps(model, slot_of_seq, device)
    return out


def _rank_main(rank: int, world: int, port: int, model_dir: str, adapter_dirs: dict[str, str],
               out_dir: str, backend: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    result = _run(model_dir, adapter_dirs, TPGroup.from_process_group(), device)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    # As the engine's workers end (``worker_entry``): no process-group teardown, whose
    # gloo threads abort a rank that ends while a peer still closes its connections
    # ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------ expected slices

def _expected_slice(name: str, whole: torch.Tensor, cfg: ModelConfig, rank: int,
                    tp: int) -> torch.Tensor:
    """Rank ``rank``'s part of the one-rank parameter ``whole``, by head arithmetic: whole
    KV heads with their query-head groups, the first ``kv_heads % tp`` ranks one KV head more
    than the others (``torch.tensor_split``'s partition)."""
    hd, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if kv_heads < tp:
        q_heads = list(range(heads))[rank * heads // tp: (rank + 1) * heads // tp]
        kv_held = [rank * kv_heads // tp]
    else:
        kv_held = torch.tensor_split(torch.arange(kv_heads), tp)[rank].tolist()
        group = heads // kv_heads
        q_heads = [h for kv in kv_held for h in range(kv * group, (kv + 1) * group)]

    def rows(held: list[int]) -> list[int]:
        return [h * hd + i for h in held for i in range(hd)]

    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        rows = -(-cfg.vocab_size // tp)
        part = whole[rank * rows: (rank + 1) * rows]
        return torch.cat([part, whole.new_zeros(rows - part.shape[0], whole.shape[1])])
    if "qkv_proj" in name:
        q, k, v = whole.split([heads * hd, kv_heads * hd, kv_heads * hd])
        return torch.cat([q[rows(q_heads)], k[rows(kv_held)], v[rows(kv_held)]])
    if "gate_up_proj" in name:
        per = cfg.intermediate_size // tp
        gate, up = whole.chunk(2)
        return torch.cat([gate[rank * per: (rank + 1) * per], up[rank * per: (rank + 1) * per]])
    if name.endswith("o_proj.weight"):
        return whole[:, rows(q_heads)]
    if name.endswith("down_proj.weight"):
        per = whole.shape[1] // tp
        return whole[:, rank * per: (rank + 1) * per]
    return whole                                    # norms, row-parallel biases


# ------------------------------------------------------------------ fixtures and test

def _cut_vocab(model_dir: Path, vocab: int) -> None:
    """Keep the first ``vocab`` rows of the embedding and LM head (a vocabulary that does
    not split evenly over the ranks)."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["vocab_size"] = vocab
    path.write_text(json.dumps(config, indent=2))
    weights = model_dir / "model.safetensors"
    state = load_file(weights)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in state:
            state[key] = state[key][:vocab].contiguous()
    save_file(state, weights, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[Path, dict[str, str]]]:
    """name -> (checkpoint, adapter dirs)."""
    root = tmp_path_factory.mktemp("tp_model")
    built = {}
    for name, (kwargs, vocab) in CASES.items():
        base = make_checkpoint(root / name, seed=5, **{**TINY, **kwargs})
        if vocab is not None:
            _cut_vocab(base, vocab)
        adapters = {a: str(make_peft_adapter(base, root / f"{name}_{a}", **spec))
                    for a, spec in ADAPTERS.items()}
        built[name] = (base, adapters)
    return built


_REFERENCE: dict[tuple[str, str], dict[str, torch.Tensor]] = {}


def _reference(name: str, base: Path, adapters: dict[str, str],
               device: torch.device) -> dict[str, torch.Tensor]:
    key = (name, device.type)
    if key not in _REFERENCE:
        _REFERENCE[key] = _run(str(base), adapters, TPGroup.single(), device)
    return _REFERENCE[key]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_ranks(cases, out_dir: Path, name: str, tp: int, backend: str) -> None:
    base, adapters = cases[name]
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    ref = _reference(name, base, adapters, device)
    mp.spawn(_rank_main, args=(tp, _free_port(), str(base), adapters, str(out_dir), backend),
             nprocs=tp, join=True)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(base), torch.float32)
    for rank in range(tp):
        got = torch.load(out_dir / f"rank{rank}.pt", weights_only=True)
        for key, whole in ref.items():
            if key.startswith(("param.", "dummy.")):
                want = _expected_slice(key, whole, cfg, rank, tp)
                assert torch.equal(got[key], want), f"rank {rank}: {key} is not its slice"
        for scenario in SCENARIOS:
            key = f"logits.{scenario}"
            assert got[key].shape == ref[key].shape == (sum(LENS) + len(LENS), cfg.vocab_size)
            err = (got[key] - ref[key]).abs().max().item()
            assert err < ATOL, f"rank {rank}, {scenario}: logits differ by {err:.2e}"
    # The adapters change the logits (so the comparisons above test them).
    assert (ref["logits.lora"] - ref["logits.base"]).abs().max() > 1e-2
    assert (ref["logits.dora"] - ref["logits.lora"]).abs().max() > 1e-2


# TP 4 once: qwen2_vocab509's two KV heads replicated over four ranks, its 509-token
# vocabulary cut unevenly, and its biases
@pytest.mark.parametrize("name, tp", [("llama_gqa", 2), ("llama_mqa_bias", 2),
                                      ("qwen2_vocab509", 2), ("qwen2_vocab509", 4),
                                      ("llama_uneven", 2)])
def test_tp_ranks_match_one_rank(cases, tmp_path, name, tp):
    _check_ranks(cases, tmp_path, name, tp, "gloo")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa_bias", "qwen2_vocab509",
                                  "llama_uneven"])
def test_tp_ranks_match_one_rank_on_gpus(cases, tmp_path, name):
    """The same over NCCL, one GPU per rank, through the Triton LoRA and attention kernels."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _check_ranks(cases, tmp_path, name, 2, "nccl")


def _config(**changes) -> ModelConfig:
    fields = dict(
        architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=96, num_layers=1,
        num_heads=6, num_kv_heads=3, head_dim=8, vocab_size=100, rms_norm_eps=1e-5,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
        sliding_windows=(None,), max_model_len=32, dtype=torch.float32, hf_config=None)
    return ModelConfig(**{**fields, **changes})


def test_shard_validates_the_split():
    cfg = _config()
    three = cfg.shard(3)
    assert (three.num_heads, three.num_kv_heads, three.intermediate_size) == (2, 1, 32)
    assert (three.q_size, three.kv_size, three.total_q_size) == (16, 8, 48)
    assert three.module_shapes() == cfg.module_shapes()
    assert three.shard(1) == cfg
    six = cfg.shard(6)                                  # 3 KV heads over 6 ranks: replicated
    assert six.num_kv_heads == 1 and six.kv_heads_replicated
    assert [six.kv_head_start(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert six.vocab_per_rank == 17
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by "
                                         "tensor_parallel_size=4"):
        cfg.shard(4)                                    # 3 KV heads replicated over 4 ranks
    with pytest.raises(ValueError, match="intermediate_size=100"):
        _config(intermediate_size=100).shard(3)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is below"):
        _config(num_heads=24).shard(8)
    with pytest.raises(ValueError, match="num_attention_heads=10 is not a multiple of "
                                         "num_key_value_heads=4"):
        _config(num_heads=10, num_kv_heads=4).shard(2)
    with pytest.raises(ValueError, match="rank 2 is outside tensor_parallel_size=2"):
        cfg.shard(2, 2)


def _split(cfg: ModelConfig, tp: int) -> list[tuple[int, int, int, int]]:
    """Per rank: (first query head, query heads, first KV head, KV heads)."""
    out = []
    for rank in range(tp):
        part = cfg.shard(tp, rank)
        assert (part.tp_rank, part.total_num_heads, part.total_num_kv_heads) == (
            rank, cfg.num_heads, cfg.num_kv_heads)
        assert part.module_shapes() == cfg.module_shapes()
        out.append((part.q_head_start(rank), part.num_heads, part.kv_head_start(rank),
                    part.num_kv_heads))
    return out


def test_shard_splits_uneven_heads_by_kv_groups():
    """Heads that do not divide: whole KV heads with their query groups, the first
    ``kv % tp`` ranks one KV head more (``torch.tensor_split``'s partition)."""
    smol = _config(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                   intermediate_size=1536)
    assert _split(smol, 2) == [(0, 6, 0, 2), (6, 3, 2, 1)]
    assert _split(smol, 3) == [(0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]
    assert smol.shard(2, 1).q_size == 192 and smol.shard(2, 1).kv_size == 64
    assert smol.shard(2) == smol.shard(2, 0) and smol.shard(2, 1).shard(1) == smol
    assert _split(_config(num_heads=12, num_kv_heads=4), 3) == [
        (0, 6, 0, 2), (6, 3, 2, 1), (9, 3, 3, 1)]
    assert _split(_config(num_heads=12, num_kv_heads=6), 4) == [
        (0, 4, 0, 2), (4, 4, 2, 2), (8, 2, 4, 1), (10, 2, 5, 1)]
    # 2 KV heads over 4 ranks: replicated, query heads split evenly
    assert _split(_config(num_heads=8, num_kv_heads=2), 4) == [
        (0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by "
                                         "tensor_parallel_size=4"):
        _config(num_heads=6, num_kv_heads=2).shard(4)


def test_single_rank_group_needs_no_process_group():
    t = torch.arange(6.0).view(2, 3)
    single = TPGroup.single()
    assert single.all_reduce(t) is t and single.all_gather(t, dim=0) is t
    assert single.even_range(10) == (0, 10)
    assert TPGroup(1, 4).even_range(8) == (2, 4)
    with pytest.raises(ValueError, match="cannot be split"):
        TPGroup(1, 4).even_range(10)
    with pytest.raises(ValueError, match="outside"):
        TPGroup(2, 2)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="not initialized"):
            TPGroup(0, 2).all_reduce(t)


def test_fully_sharded_column_slots_keep_their_rank_rows():
    """Rank 1 of 2 keeps rows 4..8 of each A padded to rank 8 (B whole along the rank, cut
    to its output rows, rank-major); the table holds each module's true rank (the same on
    every rank), and the shrink clamps it to the rows this rank holds, so it reads no row
    of A past them: rows 4 and 5 of a rank-6 adapter, none of a rank-3 one."""
    from manylora.lora.linear import LoRALinear

    layer = LoRALinear(16, (8, 4), ("gate_proj", "up_proj"), False, torch.float32,
                       torch.device("cpu"), "column", TPGroup(1, 2))
    slots = layer.create_lora_slots(("gate_proj", "up_proj"), 2, 8, fully_sharded=True)
    assert slots.rank_start == 4 and slots.lora_a_stacked[0].shape == (2, 4, 16)
    a, b = torch.randn(6, 16), torch.randn(8, 6)
    slots.set_slot(0, "gate_proj", a, b)
    slots.set_slot(1, "gate_proj", torch.randn(3, 16), torch.randn(8, 3))
    assert torch.equal(slots.lora_a_stacked[0][0, :2], a[4:6])
    assert torch.equal(slots.lora_b_stacked[0][0, :6], b[4:8].T)
    assert slots.ranks.tolist() == [[6, 0], [3, 0]]
    slots.lora_a_stacked[0][0, 2:] = float("nan")        # past rank 6: never read
    slots.lora_a_stacked[0][1] = float("nan")            # rank 3 holds none of rows 4..8
    x = torch.randn(3, 16)
    buffer = slots.shrink(x, build_lora_kernel_meta([0, 1, -1], 2, torch.device("cpu")))
    want = torch.zeros(3, 2, 4)
    want[0, 0, :2] = x[0] @ a[4:6].T
    assert torch.allclose(buffer, want, atol=1e-6)
