"""The benchmarks' model shapes (benchmarks/shapes.py) and the adapter geometry their
dummy adapters are written with (``llama3_8b.module_dims``), against the projections
transformers builds from the same configs (on the meta device: no memory, no weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.llama3_8b import module_dims
from benchmarks.shapes import SHAPES


def _layer0_projections(config: dict) -> dict[str, tuple[int, int]]:
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    hf = AutoConfig.for_model(config["model_type"], **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    layer = model.model.layers[0]
    return {name.rsplit(".", 1)[-1]: (mod.in_features, mod.out_features)
            for name, mod in layer.named_modules() if isinstance(mod, torch.nn.Linear)}


@pytest.mark.parametrize("arch", sorted(SHAPES))
@pytest.mark.parametrize("size", ["full", "tiny"])
def test_module_dims_match_transformers(arch, size):
    config = getattr(SHAPES[arch], size)
    assert module_dims(config) == _layer0_projections(config)
