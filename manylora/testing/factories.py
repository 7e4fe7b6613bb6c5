"""Build tiny, fully offline checkpoints, tokenizers and LoRA adapters for tests and demos.

Everything here is deterministic and built locally (nothing is fetched from the Hugging Face
hub): a byte-level BPE tokenizer trained on an inline corpus, LLaMA-family checkpoints written
with transformers' own ``save_pretrained`` and LoRA adapters written with peft's own
``save_pretrained``. Weights are re-initialised with a wide normal distribution so that greedy
decoding rarely meets near-ties, which keeps token-by-token comparisons meaningful.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CHAT_TEMPLATE",
    "DEMO_ADAPTER_SPECS",
    "DemoSet",
    "SUPPORTED_ARCHS",
    "make_checkpoint",
    "make_demo_set",
    "make_peft_adapter",
    "make_tokenizer",
]

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")

_SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")

# ChatML-like template; the BOS comes from the template (apply_chat_template tokenizes without
# adding special tokens), like Llama 3's.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model reads a prompt one token at
a time and predicts the next token. Serving many adapters on one base model lets a single GPU
answer requests for many fine-tuned tasks: each request names its adapter, and the engine
batches them together in one launch.

Low-rank adaptation adds a small update to a frozen weight matrix. The update is the product of
two thin matrices, A and B, scaled by alpha over the rank. Because the base weights are shared,
hundreds of adapters fit in memory at once, and swapping between them costs almost nothing.

SELECT name, count(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;
def add(a, b):
    return a + b
for i in range(10):
    total = total + i * i

Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every
morning he walked down to the harbour, pushed his boat into the water and sailed out to the
open sea. Every evening he came back with a basket of fish, and they were happy.

What is the capital of France? The capital of France is Paris. What is two plus two? Two plus
two is four. Please answer the question briefly and politely, then stop.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828 -1 +1 = < > ( ) [ ] { } / \\ | ! ? #

Unicode: café, naïve, über, façade, smörgåsbord, Ελληνικά, русский текст, 日本語のテキスト,
中文文本, 한국어, emoji 🙂🚀, em dash — and ellipsis …
"""


@lru_cache(maxsize=4)
def _train_backend_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE and return its serialized JSON (cached per vocab size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus line by line so that the merge counts are stable and high enough.
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0",
        pair="<s>:0 $A:0 <s>:1 $B:1",
        special_tokens=[("<s>", bos_id)],
    )
    return tok.to_str()


def make_tokenizer(out_dir: str | Path | None = None, *, vocab_size: int = 512) -> Any:
    """Train a tiny deterministic byte-level BPE tokenizer and (optionally) save it.

    The tokenizer is trained offline with the ``tokenizers`` library on an inline English corpus
    (with a little non-ASCII text), has the special tokens ``<s>`` (id 0), ``</s>`` (1),
    ``<unk>`` (2) and ``<pad>`` (3), prepends ``<s>`` to every encoded prompt like Llama does,
    round-trips any text exactly (byte-level; decode with ``skip_special_tokens=True``) and
    carries a ChatML-like ``chat_template`` (see :data:`CHAT_TEMPLATE`).

    Args:
        out_dir: directory to write ``tokenizer.json``, ``tokenizer_config.json`` and
            ``special_tokens_map.json`` into with ``save_pretrained`` (created if missing);
            ``None`` only returns the tokenizer.
        vocab_size: BPE target vocabulary size (including the 256 byte tokens and 4 specials).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` (``TokenizersBackend`` on transformers 5)
        that reloads with ``AutoTokenizer.from_pretrained(out_dir)`` and encodes identically.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_train_backend_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out))
        logger.debug("wrote tokenizer (%d tokens) to %s", len(tokenizer), out)
    return tokenizer


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _config_class(arch: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    if arch not in classes:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}")
    return classes[arch]


def _rope_type_of(config: Any) -> str:
    """Return the RoPE type a loaded config declares, on transformers 4.x and 5.x."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not params:
        return "default"
    return params.get("rope_type", params.get("type", "default"))


def _rope_kwargs(
    rope_scaling: Mapping[str, Any] | None, overrides: dict[str, Any]
) -> dict[str, Any]:
    """Translate a ``rope_scaling`` dict into the config keyword(s) this transformers wants.

    transformers 5 keeps everything (including ``rope_theta``) in ``rope_parameters``;
    transformers 4 has ``rope_theta`` plus an optional ``rope_scaling`` dict.
    """
    rope_theta = float(overrides.pop("rope_theta", 10000.0))
    scaling = dict(rope_scaling) if rope_scaling else None
    if scaling is not None and "rope_type" not in scaling:
        if "type" not in scaling:
            raise ValueError(f"rope_scaling needs a 'rope_type' key, got {scaling!r}")
        scaling["rope_type"] = scaling.pop("type")
    if scaling is not None:
        scaling.pop("rope_theta", None)
    if _transformers_major() >= 5:
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
        if scaling is not None:
            params.update(scaling)
        return {"rope_parameters": params}
    kwargs: dict[str, Any] = {"rope_theta": rope_theta}
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    return kwargs


@torch.no_grad()
def _reinit_(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Re-initialise every parameter: normal(0, init_std); norms: 1 + normal(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * noise
        else:
            value = init_std * noise
        param.copy_(value.to(param.dtype))


def _save_torch_bin(model: Any, out: Path, max_shard_size: int | str | None) -> None:
    """Write ``pytorch_model.bin`` (or shards plus an index) like transformers 4.x did."""
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    limit = _parse_size(max_shard_size) if max_shard_size is not None else None
    shards: list[dict[str, torch.Tensor]] = [{}]
    current = 0
    for key, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if limit is not None and shards[-1] and current + size > limit:
            shards.append({})
            current = 0
        shards[-1][key] = tensor
        current += size
    if len(shards) == 1:
        torch.save(shards[0], out / "pytorch_model.bin")
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, out / fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * units[unit])
    return int(text)


def make_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    safe_serialization: bool = True,
    init_std: float = 0.1,
    sliding_window: int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random LLaMA-family checkpoint (config, weights, tokenizer) to ``out_dir``.

    The directory receives what transformers' ``save_pretrained`` writes (``config.json``,
    ``generation_config.json``, ``model.safetensors`` or shards plus
    ``model.safetensors.index.json``), plus the :func:`make_tokenizer` files. With
    ``safe_serialization=False`` the weights go to ``pytorch_model.bin`` (or
    ``pytorch_model-0000i-of-0000n.bin`` shards plus ``pytorch_model.bin.index.json``) written
    with ``torch.save`` because transformers 5 no longer writes ``.bin`` files.

    The model is built with ``AutoModelForCausalLM.from_config`` under ``torch.manual_seed(seed)``
    and every parameter is then re-drawn from a generator seeded with ``seed``: normal(0,
    ``init_std``), norm weights 1 + normal(0, 0.1); qwen2's q/k/v biases are non-zero too. The
    weights are stored in ``dtype``. ``vocab_size`` is ``len(tokenizer)``; bos/eos/pad ids are
    set in the config and in the generation config (``eos_token_id`` = ``</s>``).

    Args:
        out_dir: target directory (created if missing).
        arch: ``"llama"``, ``"mistral"`` or ``"qwen2"``.
        rope_scaling: e.g. ``{"rope_type": "linear", "factor": 2.0}`` or a llama3 dict
            (``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``); stored as ``rope_parameters`` (with
            ``rope_theta``) on transformers 5 and as ``rope_scaling`` on transformers 4.
            ``rope_theta`` may be given in ``config_overrides`` (default 10000).
        sliding_window: Mistral's (and qwen2's, with ``use_sliding_window=True`` in
            ``config_overrides``) attention window; ``None`` means full attention.
        max_shard_size: passed to ``save_pretrained`` (e.g. ``"20KB"``) to force sharding.
        config_overrides: any other config attribute.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: unknown ``arch`` or a ``rope_scaling`` dict without a type.
        RuntimeError: the saved config does not reload with the requested RoPE type.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_cls = _config_class(arch)
    tokenizer = make_tokenizer(out)

    overrides = dict(config_overrides)
    rope_kwargs = _rope_kwargs(rope_scaling, overrides)
    if arch in ("mistral", "qwen2"):
        overrides["sliding_window"] = sliding_window
    elif sliding_window is not None:
        raise ValueError("sliding_window is only supported for mistral and qwen2")
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **rope_kwargs,
        **overrides,
    )

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model = model.to(torch.float32)
    _reinit_(model, seed, init_std)
    if tie_word_embeddings and model.get_output_embeddings() is not None:
        model.tie_weights()
    model = model.to(dtype)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    if safe_serialization:
        model.save_pretrained(str(out), **save_kwargs)
    else:
        # transformers 5 silently ignores safe_serialization=False (always safetensors).
        model.config.save_pretrained(str(out))
        model.generation_config.save_pretrained(str(out))
        _save_torch_bin(model, out, max_shard_size)
    _fix_saved_dtype(out, dtype)

    reloaded = AutoConfig.from_pretrained(str(out))
    want = rope_scaling.get("rope_type", rope_scaling.get("type")) if rope_scaling else "default"
    got = _rope_type_of(reloaded)
    if got != want:
        raise RuntimeError(f"saved config reloads with rope type {got!r}, expected {want!r}")
    logger.info("wrote %s checkpoint (%s, seed=%d) to %s", arch, dtype, seed, out)
    return out


def _fix_saved_dtype(out: Path, dtype: torch.dtype) -> None:
    """Make ``config.json`` record the stored dtype (key ``dtype`` or ``torch_dtype``)."""
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    key = "dtype" if _transformers_major() >= 5 else "torch_dtype"
    if cfg.get(key) != name:
        cfg[key] = name
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_peft_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    layers_to_transform: Sequence[int] | int | None = None,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    seed: int = 0,
    init_std: float = 0.1,
    safe_serialization: bool = True,
    use_dora: bool = False,
    bias: str = "none",
    base_model: Any = None,
) -> Path:
    """Write a random, non-trivial peft LoRA adapter for the checkpoint in ``base_dir`` (a
    folder, or a GGUF file).

    Loads the base with ``AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)``
    (``manylora.testing.hf.hf_causal_lm``),
    wraps it with ``peft.get_peft_model`` and a ``LoraConfig(task_type="CAUSAL_LM", ...)``, then
    re-draws every ``lora_A``/``lora_B`` weight from normal(0, ``init_std``) with a generator
    seeded by ``seed`` (peft initialises B to zero, which would make the adapter a no-op). With
    ``use_dora`` the magnitude vectors are scaled by 1 + normal(0, 0.1) so that they matter.
    peft's own ``save_pretrained`` writes ``adapter_config.json`` (whose
    ``base_model_name_or_path`` is ``base_dir``) and ``adapter_model.safetensors``
    (or ``adapter_model.bin`` with ``safe_serialization=False``); weights are float32.

    Args:
        target_modules: module names (list/tuple) or a regex string matched by peft.
        layers_to_transform / rank_pattern / alpha_pattern / use_rslora / use_dora / bias:
            passed to ``LoraConfig`` unchanged.
        base_model: the base already loaded by transformers from ``base_dir`` (a copy is
            wrapped), to skip loading it again.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: from peft, e.g. when ``target_modules`` matches nothing.
    """
    from peft import LoraConfig, get_peft_model

    from manylora.testing.hf import hf_causal_lm

    out = Path(out_dir)
    if base_model is not None:              # peft wraps in place: keep the caller's intact
        import copy

        model = copy.deepcopy(base_model).to(torch.float32)
    else:
        model = hf_causal_lm(base_dir, dtype=torch.float32)
    targets: list[str] | str = (
        target_modules if isinstance(target_modules, str) else list(target_modules)
    )
    layers: list[int] | int | None = (
        list(layers_to_transform)
        if layers_to_transform is not None and not isinstance(layers_to_transform, int)
        else layers_to_transform
    )
    lora_config = LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=lora_alpha,
        target_modules=targets,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        layers_to_transform=layers,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        use_dora=use_dora,
        bias=bias,
    )
    peft_model = get_peft_model(model, lora_config)
    gen = torch.Generator().manual_seed(seed)
    n_lora = 0
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.copy_((init_std * noise).to(param.dtype))
                n_lora += 1
            elif "lora_magnitude_vector" in name:
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.mul_((1.0 + 0.1 * noise).to(param.dtype))
    if n_lora == 0:
        raise ValueError(f"no LoRA weights were created for target_modules={target_modules!r}")
    peft_model.save_pretrained(str(out), safe_serialization=safe_serialization)
    logger.info("wrote LoRA adapter (r=%d, %d tensors) to %s", r, n_lora, out)
    return out


# name -> make_peft_adapter keyword arguments for the demo set.
DEMO_ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "sql": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "seed": 1},
    "chat": {
        "r": 16,
        "lora_alpha": 16,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        "use_rslora": True,
        "seed": 2,
    },
    "code": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["o_proj", "down_proj", "gate_proj", "up_proj"],
        "layers_to_transform": [1],
        "seed": 3,
    },
    "math": {
        "r": 32,
        "lora_alpha": 32,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "rank_pattern": {"o_proj": 8},
        "alpha_pattern": {"q_proj": 64},
        "seed": 4,
    },
}


@dataclass
class DemoSet:
    """A demo base checkpoint and its adapters.

    Attributes:
        base_dir: the llama checkpoint directory (see :func:`make_checkpoint`).
        adapters: adapter name -> peft adapter directory (see :func:`make_peft_adapter`).
    """

    base_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)


def make_demo_set(root: str | Path, **checkpoint_kwargs: Any) -> DemoSet:
    """Build (once) a llama base plus the four :data:`DEMO_ADAPTER_SPECS` adapters under ``root``.

    Layout: ``root/base`` (checkpoint + tokenizer), ``root/adapters/<name>`` for ``sql`` (r=8,
    q/v), ``chat`` (r=16, all seven projections, rsLoRA), ``code`` (r=4, o/down/gate/up, layer 1
    only) and ``math`` (r=32, q/k/v/o, rank_pattern ``{"o_proj": 8}``, alpha_pattern
    ``{"q_proj": 64}``), and a ``root/DONE`` marker (JSON of the build arguments) written last.
    If the marker exists with the same arguments the set is reused; otherwise any partial
    contents of ``root/base`` and ``root/adapters`` are removed and everything is rebuilt.

    Args:
        root: directory to build in (created if missing).
        checkpoint_kwargs: extra :func:`make_checkpoint` arguments (need >= 2 layers).

    Returns:
        A :class:`DemoSet` with absolute paths.
    """
    root = Path(root).absolute()
    base_dir = root / "base"
    adapters = {name: root / "adapters" / name for name in DEMO_ADAPTER_SPECS}
    marker = root / "DONE"
    signature = json.dumps(
        {"checkpoint": checkpoint_kwargs, "adapters": DEMO_ADAPTER_SPECS},
        sort_keys=True,
        default=str,
    )
    if marker.exists() and marker.read_text() == signature:
        logger.debug("reusing demo set at %s", root)
        return DemoSet(base_dir=base_dir, adapters=adapters)

    marker.unlink(missing_ok=True)
    for stale in (base_dir, root / "adapters"):
        if stale.exists():
            shutil.rmtree(stale)
    root.mkdir(parents=True, exist_ok=True)
    make_checkpoint(base_dir, "llama", **checkpoint_kwargs)
    for name, spec in DEMO_ADAPTER_SPECS.items():
        make_peft_adapter(base_dir, adapters[name], **spec)
    marker.write_text(signature)
    logger.info("built demo set at %s", root)
    return DemoSet(base_dir=base_dir, adapters=adapters)
