"""The errors a checkpoint raises when it cannot be read."""


class CheckpointError(ValueError):
    """A checkpoint cannot be used: no weight files, an unreadable file, a bad index, a missing key
    or a shape mismatch. The message names the file, key or directory at fault."""


class MissingWeightError(CheckpointError, KeyError):
    """A translated external key is in no file of the checkpoint (also a ``KeyError``)."""

    __str__ = ValueError.__str__  # KeyError would repr() the message
