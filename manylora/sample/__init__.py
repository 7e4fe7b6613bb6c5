"""Token sampling: the batched :class:`Sampler` and its per-step :class:`SamplingTensors`."""

from manylora.sample.sampler import Sampler, SamplingTensors, make_generator

__all__ = ["Sampler", "SamplingTensors", "make_generator"]
