"""The one exception type of the checkpoint loaders."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be read, recognised or loaded into the given model.

    The message says which file or keys are at fault and what to do about it.
    """
