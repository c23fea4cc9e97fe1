"""The checkpoint formats keras_vit reads and writes, one row each (`common.CheckpointFormat`,
declared in its `format_<name>` module): the loader, the writers, `save_pretrained`, the model
card and the CLI's choices read this table. Adding a format is one module and one entry here
(CONTRIBUTING.md)."""

from __future__ import annotations

from keras_vit.checkpoints import format_google_npz, format_hf, format_timm
from keras_vit.checkpoints.common import CheckpointFormat

__all__ = ["FORMATS", "get_format"]

FORMATS: dict[str, CheckpointFormat] = {
    row.name: row for row in (format_google_npz.FORMAT, format_timm.FORMAT, format_hf.FORMAT)
}


def get_format(name: str) -> CheckpointFormat:
    """The row of format `name`; a `ValueError` listing the formats for any other name."""
    if name not in FORMATS:
        raise ValueError(f"Unknown checkpoint format {name!r}: use one of {sorted(FORMATS)}.")
    return FORMATS[name]
