"""Token sampling: the batched :class:`Sampler` and its per-step :class:`SamplingTensors`."""

from manylora.sample.generators import make_generator
from manylora.sample.sampler import Sampler, SamplingTensors

__all__ = ["Sampler", "SamplingTensors", "make_generator"]
