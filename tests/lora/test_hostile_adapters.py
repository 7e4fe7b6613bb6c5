"""Hostile and careless adapters (issue 18, findings 2, 3, 6) against the format readers:
each malformed class is a ``LoRAAdapterError`` that names the adapter once and the problem,
never another exception type; a FIFO or device is refused without blocking; pattern keys
are matched as peft's own ``get_pattern_key`` matches them (the reference), with bounded
work; weights too large to compute with are refused while trained-size ones load."""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file, save_file

from manylora.lora.adapter import LoRAAdapterError, check_delta
from manylora.lora.formats.loader import check_adapter_dir, load_adapter_dir
from manylora.lora.formats.patterns import MatchBudget, PatternTable
from manylora.lora.formats.peft import load_peft_adapter
from manylora.lora.formats.trtllm import adapter_from_trtllm, adapter_to_trtllm
from manylora.lora_request import LoRARequest
from manylora.testing import make_peft_adapter

NAME = "hostile"
MODULES = [f"model.layers.{i}.{block}.{m}" for i in range(2)
           for block, ms in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj"))) for m in ms]


@pytest.fixture(scope="module")
def good(base_dir, lora_root) -> Path:
    return make_peft_adapter(base_dir, lora_root / "hostile_good", r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj", "down_proj"], seed=61)


def _copy(good: Path, tmp_path: Path, name: str = NAME) -> Path:
    return Path(shutil.copytree(good, tmp_path / name))


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    save_file(edit(tensors), path / "adapter_model.safetensors")


def _load(path: Path, target):
    return load_adapter_dir(LoRARequest(NAME, 1, str(path)), path, target)


def _in_thread(fn, *args):
    """``fn(*args)`` on a daemon thread: its exception, or a failure if it blocks (a FIFO
    opened for reading would block until a writer appears)."""
    box: list = []

    def run():
        try:
            box.append(fn(*args))
        except BaseException as e:
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"{fn.__name__} blocked"
    return box[0]


def _rank0(t):
    return {k: (v[:0] if "lora_A" in k else v[:, :0]) for k, v in t.items()}


def _scalar(t):
    return {k: (v[0, 0] if "lora_A" in k else v) for k, v in t.items()}


def _ints(t):
    return {k: v.to(torch.int64) for k, v in t.items()}


def _huge(t):
    return {k: torch.full_like(v, 1e38) for k, v in t.items()}


CONFIG_CASES = [
    ("alpha_null", dict(lora_alpha=None), r"lora_alpha = None is not a finite number"),
    ("alpha_string", dict(lora_alpha="16"), r"lora_alpha = '16' is not a finite number"),
    ("alpha_bool", dict(lora_alpha=True), r"lora_alpha = True is not a finite number"),
    ("r_string", dict(r="4"), r"r = '4' is not a positive integer"),
    ("r_zero", dict(r=0), r"r = 0 is not a positive integer"),
    ("rslora_string", dict(use_rslora="yes"), r"use_rslora = 'yes' is not true or false"),
    ("targets_int", dict(target_modules=3), r"target_modules = 3 is neither"),
    ("invalid_regex_key", dict(alpha_pattern={"q_proj(": 4}),
     r"alpha_pattern key 'q_proj\(' is not a valid regular expression"),
    ("pattern_not_dict", dict(rank_pattern=["q_proj"]), r"rank_pattern must be an object"),
    ("rank_value_string", dict(rank_pattern={"q_proj": "4"}),
     r"rank_pattern\['q_proj'\] = '4' is not a positive integer rank"),
    ("alpha_value_nan", dict(alpha_pattern={"q_proj": float("nan")}),
     r"alpha_pattern\['q_proj'\] = nan is not a finite number"),
    ("key_too_long", dict(alpha_pattern={"q" * 600: 4}), r"600 characters long"),
    ("regex_keys_too_long", dict(rank_pattern={f"(q|k){i}" + "x?" * 200: 4 for i in range(12)}),
     r"the regex keys of rank_pattern hold more than 2048 characters"),
]

TENSOR_CASES = [
    ("rank0", _rank0, r"rank must agree and be at least 1"),
    ("scalar", _scalar, r"not 2-D \[r, in\] and \[out, r\]"),
    ("int_dtype", _ints, r"of dtype torch.int64, not a floating-point dtype"),
    ("huge", _huge, r"too large to compute with"),
]


@pytest.mark.parametrize("case,changes,pattern", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_is_refused_on_arrival(good, tmp_path, adapter_target, case, changes,
                                          pattern):
    bad = _copy(good, tmp_path)
    _edit_config(bad, **changes)
    with pytest.raises(LoRAAdapterError, match=pattern) as info:
        check_adapter_dir(LoRARequest(NAME, 1, str(bad)), bad, adapter_target)
    assert str(info.value).count(f"adapter {NAME!r}") == 1
    assert str(tmp_path) not in str(info.value)
    with pytest.raises(LoRAAdapterError, match=pattern):
        _load(bad, adapter_target)


@pytest.mark.parametrize("case,edit,pattern", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_bad_tensors_are_refused_at_read(good, tmp_path, adapter_target, case, edit, pattern):
    bad = _copy(good, tmp_path)
    _edit_tensors(bad, edit)
    with pytest.raises(LoRAAdapterError, match=pattern) as info:
        _load(bad, adapter_target)
    assert str(info.value).count(f"adapter {NAME!r}") == 1
    assert str(tmp_path) not in str(info.value)


@pytest.mark.parametrize("file", ["adapter_config.json", "adapter_model.safetensors"])
def test_fifo_is_refused_without_blocking(good, tmp_path, adapter_target, file):
    bad = _copy(good, tmp_path)
    (bad / file).unlink()
    os.mkfifo(bad / file)
    error = _in_thread(_load, bad, adapter_target)
    assert isinstance(error, LoRAAdapterError), error
    assert f"{file} is a FIFO, not a regular file" in str(error)
    assert str(tmp_path) not in str(error)
    if file == "adapter_config.json":
        error = _in_thread(check_adapter_dir, LoRARequest(NAME, 1, str(bad)), bad,
                           adapter_target)
        assert isinstance(error, LoRAAdapterError) and "is a FIFO" in str(error)


def test_device_and_directory_are_refused(good, tmp_path, adapter_target):
    bad = _copy(good, tmp_path)
    (bad / "adapter_model.safetensors").unlink()
    (bad / "adapter_model.safetensors").symlink_to("/dev/zero")
    error = _in_thread(_load, bad, adapter_target)
    assert isinstance(error, LoRAAdapterError)
    assert "adapter_model.safetensors is a character device" in str(error)
    (bad / "adapter_config.json").unlink()
    (bad / "adapter_config.json").mkdir()
    with pytest.raises(LoRAAdapterError, match="adapter_config.json is a directory"):
        _load(bad, adapter_target)


def test_symlink_loop_is_refused(good, tmp_path, adapter_target):
    bad = _copy(good, tmp_path)
    (bad / "adapter_config.json").unlink()
    (bad / "adapter_config.json").symlink_to(bad / "adapter_config.json")
    with pytest.raises(LoRAAdapterError, match="adapter_config.json is a symlink loop"):
        _load(bad, adapter_target)


def test_pickle_with_objects_is_refused_plainly(good, tmp_path, adapter_target):
    bad = _copy(good, tmp_path)
    tensors = load_file(bad / "adapter_model.safetensors")
    (bad / "adapter_model.safetensors").unlink()
    torch.save({**tensors, "extra": datetime.date(2020, 1, 1)}, bad / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError) as info:
        _load(bad, adapter_target)
    message = str(info.value)
    assert message == (f"adapter {NAME!r}: cannot read adapter_model.bin: it holds Python "
                       "objects other than tensors, which are never unpickled (weights_only)")
    bad.joinpath("adapter_model.bin").write_bytes(b"\x80\x04not a pickle at all")
    with pytest.raises(LoRAAdapterError, match="cannot read adapter_model.bin: ") as info:
        _load(bad, adapter_target)
    assert "\x1b" not in str(info.value) and "\n" not in str(info.value)


def test_oversized_config_is_refused(good, tmp_path, adapter_target):
    bad = _copy(good, tmp_path)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["padding"] = "x" * (2 << 20)
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoRAAdapterError, match="adapter_config.json is larger than"):
        _load(bad, adapter_target)


def test_patterns_match_as_peft_does():
    """Plain, dotted (``.`` is a regex wildcard in peft), anchored and regex keys, in order:
    the first that matches wins; the reference is peft's ``get_pattern_key``."""
    patterns = {"layers.1.self_attn.v_proj": 2, r"layers\.[01]\.mlp\.(up|down)_proj": 3,
                "q_proj": 5, "model.layers.0.mlp.gate_proj": 6, "layers.1.self_attn.k.proj": 7,
                "o_proj|gate_proj": 9, "proj": 11, "ayers.0.self_attn.k_proj": 12,
                "0.self_attn.k_proj": 13}
    table = PatternTable("rank_pattern", patterns, "adapter 'p'", MatchBudget())
    for module in MODULES:
        key = get_pattern_key(list(patterns), module)
        expected = patterns.get(key, -1)
        assert table.value(module, -1) == expected, module


def test_literal_keys_match_as_the_regex_does():
    r"""Keys of word characters and dots skip the regex engine; on random suffixes of module
    names, some characters turned into ``.`` wildcards, they match exactly as peft's regex
    ``(.*\.)?(key)$`` does under ``re``."""
    gen = random.Random(0)
    checked = 0
    for _ in range(400):
        source = gen.choice(MODULES)
        key = list(source[gen.randrange(len(source)):])
        for i in range(len(key)):
            if gen.random() < 0.15:
                key[i] = "."
        key = "".join(key)
        if not key or not re.fullmatch(r"[\w.]+", key):
            continue
        table = PatternTable("rank_pattern", {key: 1}, "adapter 'p'", MatchBudget())
        for module in MODULES:
            expected = 1 if re.match(rf"(.*\.)?({key})$", module) else 0
            assert table.value(module, 0) == expected, (key, module)
            checked += 1
    assert checked > 1000


def test_pathological_pattern_is_bounded(good, tmp_path, adapter_target):
    """The issue's key took 8 s under ``re`` and held the GIL; it cannot match (no module
    name holds an X), so it is refused as a key that matches nothing, within its budget."""
    slow = _copy(good, tmp_path, "slow")
    key = "(.?)*(.?)*(.?)*(.?)*(.?)*X"
    _edit_config(slow, alpha_pattern={key: 1000})
    with pytest.raises(LoRAAdapterError, match=re.escape(f"alpha_pattern keys [{key!r}] match "
                                                         "no module")):
        load_peft_adapter(LoRARequest(NAME, 1, str(slow)), slow, adapter_target)


def test_backtracking_pattern_fails_within_its_budget(good, tmp_path, adapter_target):
    """A key that backtracks without bound on the module names ends the read with an error
    naming it (one budget per adapter), not a stall."""
    bad = _copy(good, tmp_path)
    key = r"(\w|.)*(\w|.)*(\w|.)*(\w|.)*j\b\d"
    _edit_config(bad, rank_pattern={key: 4})
    with pytest.raises(LoRAAdapterError, match=r"matching rank_pattern key .* took more than"):
        _load(bad, adapter_target)


def test_delta_rule_accepts_trained_sizes_and_refuses_huge():
    gen = torch.Generator().manual_seed(0)
    # values within ±10, rank 64 over a 4096-wide projection: far above trained adapters
    a = (torch.rand(64, 4096, generator=gen) * 20 - 10)
    b = (torch.rand(4096, 64, generator=gen) * 20 - 10)
    check_delta("m", a, b)
    check_delta("m", a.to(torch.bfloat16), b.to(torch.bfloat16))
    check_delta("m", a * 1e-3, b * 1e-3)
    with pytest.raises(LoRAAdapterError, match=r"m: its weights are too large"):
        check_delta("m", a * 1e4, b * 1e4)                   # finite probe, gain 1e16
    with pytest.raises(LoRAAdapterError, match=r"lora_A overflows torch.float16"):
        check_delta("m", (a * 1e4).to(torch.float16), b.to(torch.float16))
    with pytest.raises(LoRAAdapterError, match=r"too large to compute with"):
        check_delta("m", torch.full((4, 32), 1e38), torch.full((32, 4), 1e38))


def test_huge_trtllm_rows_are_refused(good, adapter_target):
    adapter = load_peft_adapter(LoRARequest(NAME, 1, str(good)), good, adapter_target)
    weights, config = adapter_to_trtllm(adapter, torch.float32)
    adapter_from_trtllm(1, NAME, weights, config, adapter_target)
    with pytest.raises(LoRAAdapterError, match=r"'hostile': row 0: its weights are too large"):
        adapter_from_trtllm(1, NAME, torch.full_like(weights, 1e38), config, adapter_target)


# ---------------------------------------------------------------- structure before data

#: A tensor of 2 GiB as a safetensors header declares it (float32 [16384, 32768]).
BIG = ([16384, 32768], 4 * 16384 * 32768)
PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"


def _sparse_safetensors(path: Path, tensors: dict[str, tuple[list[int], int]],
                        data_bytes: int | None = None) -> None:
    """Write ``path`` as a safetensors file whose header declares ``tensors`` (``{key:
    (shape, bytes)}``, float32, back to back) and whose data is a hole (a sparse file: no
    disk, no memory), ``data_bytes`` long (default: what the header declares)."""
    header, offset = {}, 0
    for key, (shape, nbytes) in tensors.items():
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + (offset if data_bytes is None else data_bytes))


def _rss() -> int:
    """This process's resident memory, bytes (``VmRSS``)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024


def _refused_without_reading(monkeypatch, path: Path, target, pattern: str) -> None:
    """The load of ``path`` fails with ``pattern`` having read no tensor's data: no
    ``PeftWeights.read`` call, and resident memory grows by far less than the 2 GiB the
    header declares."""
    from manylora.lora.formats import peft_weights

    reads: list[str] = []
    original = peft_weights.PeftWeights.read
    monkeypatch.setattr(peft_weights.PeftWeights, "read",
                        lambda self, key: reads.append(key) or original(self, key))
    before = _rss()
    with pytest.raises(LoRAAdapterError, match=pattern) as info:
        _load(path, target)
    assert reads == []
    assert _rss() - before < 256 << 20
    assert str(info.value).count(f"adapter {NAME!r}") == 1


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS")
def test_sparse_weights_without_b_are_refused_from_the_header(good, tmp_path, adapter_target,
                                                              monkeypatch):
    """The issue's file: 2 GiB declared for lora_A, no lora_B. Its header says enough."""
    bad = _copy(good, tmp_path)
    _sparse_safetensors(bad / "adapter_model.safetensors",
                        {f"{PREFIX}.lora_A.weight": BIG})
    assert (bad / "adapter_model.safetensors").stat().st_size > 2 << 30
    _refused_without_reading(monkeypatch, bad, adapter_target,
                             r"model.layers.0.self_attn.q_proj has lora_A but not both A and B")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS")
def test_header_claiming_more_than_the_file_is_refused(good, tmp_path, adapter_target,
                                                       monkeypatch):
    bad = _copy(good, tmp_path)
    weights = bad / "adapter_model.safetensors"
    _sparse_safetensors(weights, {f"{PREFIX}.lora_A.weight": BIG,
                                  f"{PREFIX}.lora_B.weight": ([32, 16384], 4 * 32 * 16384)},
                        data_bytes=1 << 20)
    size = weights.stat().st_size
    _refused_without_reading(monkeypatch, bad, adapter_target,
                             rf"adapter_model.safetensors: its safetensors header places tensor "
                             rf"data up to byte \d+, but the file holds {size} bytes")
    weights.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    _refused_without_reading(monkeypatch, bad, adapter_target,
                             r"its safetensors header claims 1099511627776 bytes, more than")
    weights.write_bytes((100).to_bytes(8, "little") + b"{}")
    _refused_without_reading(monkeypatch, bad, adapter_target,
                             r"its safetensors header claims 100 bytes, but the file holds 10")


def test_shapes_are_checked_before_data(good, tmp_path, adapter_target, monkeypatch):
    """A and B of 2 GiB that the base projection cannot take: refused by shape, unread."""
    bad = _copy(good, tmp_path)
    _sparse_safetensors(bad / "adapter_model.safetensors",
                        {f"{PREFIX}.lora_A.weight": BIG,
                         f"{PREFIX}.lora_B.weight": ([32, 16384], 4 * 32 * 16384)})
    _refused_without_reading(monkeypatch, bad, adapter_target,
                             r"has lora_A \(16384, 32768\) and lora_B \(32, 16384\), but the "
                             r"base projection needs")


def test_trtllm_npy_header_claiming_more_than_the_file_is_refused(good, tmp_path,
                                                                 adapter_target):
    """A ``.npy`` whose header declares 2 GiB over a 1 MiB file: refused from the header
    (``np.load`` would have allocated the array first)."""
    import numpy as np

    from manylora.lora.formats.trtllm_npy import WEIGHTS_FILE, write_trtllm_dir

    adapter = load_peft_adapter(LoRARequest(NAME, 1, str(good)), good, adapter_target)
    out = write_trtllm_dir(tmp_path / "trt", *adapter_to_trtllm(adapter, torch.float32))
    header = {"descr": "<f4", "fortran_order": False, "shape": (1, 16384, 32768)}
    with open(out / WEIGHTS_FILE, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.truncate(f.tell() + (1 << 20))
    before = _rss()
    with pytest.raises(LoRAAdapterError, match=r"model.lora_weights.npy: its header declares "
                       r"a float32 array of shape \[1, 16384, 32768\] \(2147483648 bytes\), "
                       r"but the file holds 1048576 bytes of data"):
        _load(out, adapter_target)
    assert _rss() - before < 256 << 20


def test_trtllm_rows_are_read_only_where_used(good, tmp_path, adapter_target):
    """Rows padded to a sparse 2 GiB width load as the unpadded adapter: only the used
    part of each row is read."""
    import numpy as np

    from manylora.lora.formats.trtllm_npy import CONFIG_FILE, WEIGHTS_FILE

    adapter = load_peft_adapter(LoRARequest(NAME, 1, str(good)), good, adapter_target)
    weights, config = adapter_to_trtllm(adapter, torch.float32)
    rows, width = weights.shape[-2], (2 << 30) // 4 // weights.shape[-2]
    out = tmp_path / "trt_wide"
    out.mkdir()
    np.save(out / CONFIG_FILE, config.numpy())
    with open(out / WEIGHTS_FILE, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": (1, rows, width)})
        start = f.tell()
        for i, row in enumerate(weights.reshape(rows, -1).numpy()):
            f.seek(start + i * width * 4)
            f.write(row.tobytes())
        f.truncate(start + rows * width * 4)
    before = _rss()
    got = _load(out, adapter_target)
    assert _rss() - before < 256 << 20
    assert got.digest == adapter_from_trtllm(1, NAME, weights, config, adapter_target).digest


# ---------------------------------------------------------------- what peft refuses

@pytest.fixture(scope="module")
def peft_base(base_dir):
    from transformers import AutoModelForCausalLM
    return lambda: AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)


PEFT_CASES = [
    # (case, config changes, peft's reaction: raises / warns, what ours says)
    ("layer_past_the_model", dict(layers_to_transform=[99]), "raises",
     r"layers_to_transform names layers \[99\], which the base model does not have "
     r"\(it has 2 layers\)"),
    ("layers_pattern_matching_nothing", dict(layers_to_transform=[0], layers_pattern="h"),
     "raises", r"target modules \[('\w+', ){2}'\w+'\] not found in the base model .*"
     r"layers_to_transform is \[0\], layers_pattern 'h'"),
    ("regex_matching_nothing", dict(target_modules=r".*\.nothing_proj"), "raises",
     r"target modules '\.\*\\\\.nothing_proj' not found in the base model"),
    ("rank_key_matching_nothing", dict(rank_pattern={"nothing_proj": 4}), "warns",
     r"rank_pattern keys \['nothing_proj'\] match no module the adapter targets"),
    ("alpha_key_not_targeted", dict(alpha_pattern={"q_proj": 4, "o_proj": 2}), "warns",
     r"alpha_pattern keys \['o_proj'\] match no module the adapter targets"),
]


@pytest.mark.parametrize("case,changes,reaction,pattern", PEFT_CASES,
                         ids=[c[0] for c in PEFT_CASES])
def test_what_peft_refuses_is_refused(good, tmp_path, adapter_target, peft_base, case,
                                      changes, reaction, pattern):
    """The reference is peft's own ``get_peft_model`` on the same config and base: it raises
    (``Target modules ... not found in the base model``) or warns that the keys matched
    nothing and were ignored; ours refuses, naming them."""
    from peft import LoraConfig, get_peft_model

    cfg = {**json.loads((good / "adapter_config.json").read_text()), **changes}
    fields = {k: cfg[k] for k in ("r", "lora_alpha", "target_modules", "layers_to_transform",
                                  "layers_pattern", "rank_pattern", "alpha_pattern")}
    if reaction == "raises":
        with pytest.raises(ValueError, match="not found in the base model"):
            get_peft_model(peft_base(), LoraConfig(**fields))
    else:
        with pytest.warns(RuntimeWarning, match="did not match any targeted module"):
            get_peft_model(peft_base(), LoraConfig(**fields))
    bad = _copy(good, tmp_path)
    _edit_config(bad, **changes)
    with pytest.raises(LoRAAdapterError, match=pattern) as info:
        _load(bad, adapter_target)
    assert str(info.value).count(f"adapter {NAME!r}") == 1


def test_rank_pattern_past_max_lora_rank_is_refused_on_arrival(good, tmp_path, adapter_target,
                                                               peft_base):
    """peft builds q_proj at rank 100000 and then cannot load the rank-4 weights; ours
    refuses the rank at once, as vLLM refuses an ``r`` past ``max_lora_rank``."""
    from peft import PeftModel

    bad = _copy(good, tmp_path)
    _edit_config(bad, rank_pattern={"q_proj": 100000})
    with pytest.raises(RuntimeError, match="size mismatch"):
        PeftModel.from_pretrained(peft_base(), bad)
    with pytest.raises(LoRAAdapterError, match=r"rank_pattern\['q_proj'\] = 100000 exceeds "
                       r"max_lora_rank=16"):
        check_adapter_dir(LoRARequest(NAME, 1, str(bad)), bad, adapter_target)


def test_weights_for_modules_the_config_does_not_target_are_refused(good, tmp_path,
                                                                    adapter_target, peft_base):
    """peft loads only the layers ``layers_to_transform`` names (the others' weights are
    unused); ours refuses weights it would have to drop."""
    bad = _copy(good, tmp_path)
    _edit_config(bad, layers_to_transform=[1])
    with pytest.raises(LoRAAdapterError, match=r"has weights for model.layers.0.\w+.\w+_proj"
                       r", which its config's target_modules / layers_to_transform do "
                       r"not target"):
        _load(bad, adapter_target)


def test_bin_weights_load_as_safetensors_do(base_dir, tmp_path, adapter_target):
    """``adapter_model.bin`` (torch's zip format) and the legacy pickle format read the same
    adapter as ``adapter_model.safetensors``."""
    kwargs = dict(r=4, target_modules=["q_proj", "down_proj"], seed=62)
    st = make_peft_adapter(base_dir, tmp_path / "st", **kwargs)
    as_bin = make_peft_adapter(base_dir, tmp_path / "bin", safe_serialization=False, **kwargs)
    ref = _load(st, adapter_target)
    assert _load(as_bin, adapter_target).digest == ref.digest
    tensors = load_file(st / "adapter_model.safetensors")
    torch.save(tensors, as_bin / "adapter_model.bin", _use_new_zipfile_serialization=False)
    assert _load(as_bin, adapter_target).digest == ref.digest


def test_weights_truncated_while_read_are_an_error(good, tmp_path):
    """Tensor data is read from the file, not through a memory map: a file cut short after
    its header was checked is a named error, not SIGBUS."""
    from manylora.lora.formats.peft_weights import open_peft_weights

    bad = _copy(good, tmp_path)
    weights = bad / "adapter_model.safetensors"
    with open_peft_weights(bad, NAME) as stored:
        key = max(stored.meta)
        os.truncate(weights, 64)
        with pytest.raises(LoRAAdapterError, match=rf"adapter_model.safetensors: the file ended "
                           rf"within tensor {re.escape(repr(key))}'s data"):
            stored.read(key)
