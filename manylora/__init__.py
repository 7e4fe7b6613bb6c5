"""manylora: serve many LoRA adapters on one shared base model, batched in one launch."""

from manylora.engine.arg_utils import EngineArgs
from manylora.engine.llm_engine import LLMEngine
from manylora.engine.outputs import CompletionOutput, RequestOutput
from manylora.entrypoints.llm import LLM
from manylora.lora_request import LoRARequest
from manylora.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "LoRARequest", "RequestOutput",
           "CompletionOutput"]
