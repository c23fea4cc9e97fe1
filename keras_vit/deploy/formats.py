"""The export formats, one row each: the CLI's `--format` choices and help, which export flags each
format honours (the rest are refused before anything runs) and the writer that `keras-vit export`
calls all read this table. Pure Python, so the parser reads it without TensorFlow."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EXPORT_FORMATS", "EXPORT_OPTIONS", "ExportFormat", "refused_options"]


@dataclass(frozen=True)
class ExportFormat:
    """One export format: its name, what it writes, the export flags it honours and its writer."""

    name: str  # `--format NAME`
    writes: str  # what EXPORT_DIR becomes, for the help
    target: str  # "folder" (a version folder is written inside it) or "file"
    options: tuple[str, ...]  # the `keras-vit export` flags (argparse dests) this format honours
    writer: str  # its function in `keras_vit.deploy.export`


EXPORT_FORMATS: dict[str, ExportFormat] = {
    row.name: row
    for row in (
        ExportFormat(
            "saved_model",
            "a TF Serving SavedModel, EXPORT_DIR/VERSION (default)",
            "folder",
            ("version", "top_k", "labels", "max_pixels", "no_warmup"),
            "export_serving",
        ),
        ExportFormat("onnx", "a .onnx file", "file", ("preprocessing",), "export_onnx"),
        ExportFormat("litert", "a .tflite file", "file", ("preprocessing", "int8"), "export_litert"),
    )
}
# Every format flag, in the order the formats declare them (the order errors list them in).
EXPORT_OPTIONS = tuple(dict.fromkeys(option for row in EXPORT_FORMATS.values() for option in row.options))


def refused_options(format: str) -> dict[str, tuple[str, ...]]:
    """The format flags `format` does not honour, each with the formats that do."""
    honoured = EXPORT_FORMATS[format].options
    return {
        option: tuple(row.name for row in EXPORT_FORMATS.values() if option in row.options)
        for option in EXPORT_OPTIONS
        if option not in honoured
    }
