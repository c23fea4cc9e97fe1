"""Share a keras_vit model: write it in a published format, upload it to the Hub, load it back.

```python
keras_vit.save_pretrained(model, "my_vit", format="timm")   # or "hf", "google_npz"
keras_vit.push_to_hub(model, "user/my-vit", report="vit_run/report.json")
model = keras_vit.load_pretrained("hf-hub:user/my-vit")     # or the local folder
```

A folder holds the format's own files (timm: `model.safetensors` + timm's `config.json`;
transformers: `model.safetensors` + `config.json` + `preprocessor_config.json`; Google:
`model.npz`), so timm (`timm.create_model("hf-hub:user/my-vit", pretrained=True)`) and
transformers (`ViTForImageClassification.from_pretrained("user/my-vit")`) load it as their
own, plus `keras_vit.json` (the model's exact keras_vit config, numerics included, the
preprocessing and the class names) that `load_pretrained` rebuilds it from, and a model card
`README.md`. A model the format cannot express raises `NotExpressibleError` naming what does
not fit, before anything is written.

Nothing else in the folder is touched: `save_pretrained` writes only its own files (the
format's, `keras_vit.json`, `README.md`), a new folder beside its place then renamed into it,
and `overwrite=True` replaces only what an earlier `save_pretrained` wrote there (the files
its `keras_vit.json` lists, unchanged since), never the folder's other contents. `keras_vit.json`
records the SHA-256 of every file written but the model card (`files`; the card's,
`card_sha256`, only tells `overwrite` whether it was edited since) and of its own content
(`sha256`); `load_pretrained`, `create_model(pretrained=folder)` and `load_weights` verify them,
so a changed weight or an edited config is an error naming the file (`verify=False` loads files
edited on purpose).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import keras

from keras_vit.checkpoints.formats import FORMATS, get_format
from keras_vit.checkpoints.pretrained import (
    HUB_PREFIX,
    METADATA_FILE,
    metadata_sha256,
    read_shared,
    resolve_pretrained,
    verify_shared,
)
from keras_vit.checkpoints.write_common import NotExpressibleError, check_writable
from keras_vit.registry.catalog import Preprocessing, class_names, preprocessing_for
from keras_vit.registry.variants import ViTConfig
from keras_vit.utils.files import ChecksumError, file_sha256, write_owned
from keras_vit.version import __version__

__all__ = [
    "ChecksumError",
    "METADATA_FILE",
    "NotExpressibleError",
    "load_pretrained",
    "model_card",
    "push_to_hub",
    "read_metadata",
    "save_pretrained",
    "verify_shared",
]

CARD_FILE = "README.md"


def _labels(model: keras.Model, labels: Sequence[str] | None) -> list[str] | None:
    """`labels` checked against the head, else the catalog's ImageNet-1k names for such a model, else None."""
    return class_names(model, model.num_classes if model.head is not None else None, labels)


def _report(report: str | os.PathLike | Mapping | None) -> dict | None:
    if report is None or isinstance(report, Mapping):
        return None if report is None else dict(report)
    with open(report, encoding="utf-8") as file:
        return json.load(file)


def _metadata(model: keras.Model, format: str, weights: str, preprocessing: Preprocessing, labels) -> dict:
    spec = {
        "image_size": list(preprocessing.image_size),
        "mean": list(preprocessing.mean),
        "std": list(preprocessing.std),
        "crop_pct": preprocessing.crop_pct,
        "interpolation": preprocessing.interpolation,
        "channel_order": preprocessing.channel_order,
        "resampler": preprocessing.resampler,
    }
    return {
        "keras_vit_version": __version__,
        "format": format,
        "weights": weights,
        "model": model.get_config(),
        "preprocessing": spec,
        "labels": labels,
    }


def _earlier_output(directory: Path) -> set[str]:
    """The files an earlier `save_pretrained` wrote into `directory` and nobody changed since: those its
    `keras_vit.json` names with the SHA-256 they still have (`files`, `card_sha256` for the card)."""
    try:
        metadata = json.loads((directory / METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        metadata = None
    if not isinstance(metadata, dict):  # none, or damaged: only the record itself is keras_vit's
        return {METADATA_FILE} if (directory / METADATA_FILE).is_file() else set()
    recorded = dict(metadata.get("files") or {})
    recorded[CARD_FILE] = metadata.get("card_sha256")
    return {
        name
        for name, digest in recorded.items()
        if isinstance(name, str)
        and name == os.path.basename(name)
        and (directory / name).is_file()
        and not (directory / name).is_symlink()
        and file_sha256(directory / name) == digest
    } | {METADATA_FILE}


def _signed(metadata: dict) -> dict:
    """`metadata` with the SHA-256 of its own content (`sha256`): an edit of any value is detected."""
    content = {key: value for key, value in metadata.items() if key != "sha256"}
    return {**content, "sha256": metadata_sha256(content)}


def save_pretrained(
    model: keras.Model,
    directory: str | os.PathLike,
    format: str = "timm",
    *,
    labels: Sequence[str] | None = None,
    preprocessing: Preprocessing | None = None,
    report: str | os.PathLike | Mapping | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `model` into the folder `directory` as a `format` checkpoint; returns the folder.

    Args:
        model: a keras_vit `ViT` (not quantized).
        directory: the folder to write into; its other files are kept.
        format: `"timm"`, `"hf"` (transformers) or `"google_npz"`.
        labels: class names in head order, default the catalog's (ImageNet-1k names for a
            1000-class model built from a tag), else none (`LABEL_i` in the transformers config).
        preprocessing: the model's `Preprocessing`, default `preprocessing_for(model)`.
        report: a training run's `report.json` (path or dict) for the model card.
        overwrite: replace keras_vit's own earlier output in `directory` (the files an earlier
            `save_pretrained` wrote there, listed in its `keras_vit.json` with the checksum they
            still have), and only that: a file since edited or replaced, the model card included,
            is the user's.

    Raises `NotExpressibleError` for a model the format cannot express, `FileExistsError` for
    earlier output without `overwrite` or a file of the same name that keras_vit did not
    write, before anything is written. `keras_vit.json` records the SHA-256 of the files
    written (all but the model card) and of itself, for `load_pretrained` to verify.
    """
    writer = get_format(format)
    check_writable(model, format)
    writer.check(model)
    directory = Path(directory)
    names = {*writer.files, METADATA_FILE, CARD_FILE}
    labels = _labels(model, labels)
    preprocessing = preprocessing or preprocessing_for(model)
    run_report = _report(report)

    def fill(staging: Path) -> None:
        weights = writer.write(model, staging, preprocessing, labels)
        metadata = _metadata(model, format, weights, preprocessing, labels)
        (staging / CARD_FILE).write_text(model_card(model, metadata, run_report), encoding="utf-8")
        metadata["files"] = {name: file_sha256(staging / name) for name in sorted(writer.files)}
        metadata["card_sha256"] = file_sha256(staging / CARD_FILE)  # not verified on load: for overwrite
        signed = _signed(metadata)
        (staging / METADATA_FILE).write_text(json.dumps(signed, indent=2), encoding="utf-8")

    return write_owned(
        directory,
        names,
        fill,
        earlier=_earlier_output(directory) if directory.is_dir() else (),
        overwrite=overwrite,
        last=METADATA_FILE,
    )


def push_to_hub(
    model: keras.Model,
    repo_id: str,
    format: str = "timm",
    *,
    labels: Sequence[str] | None = None,
    preprocessing: Preprocessing | None = None,
    report: str | os.PathLike | Mapping | None = None,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Write `model` as `save_pretrained` does and upload the folder to the Hugging Face Hub repo `repo_id`.

    Uses `huggingface_hub.create_repo(repo_id, exist_ok=True)` and `upload_folder`; `token`
    defaults to the logged-in one (`huggingface-cli login` / `HF_TOKEN`). Returns the commit's URL.
    Load it back with `keras_vit.load_pretrained("hf-hub:<repo_id>")`.
    """
    import huggingface_hub

    with tempfile.TemporaryDirectory(prefix="keras_vit-push-") as workspace:
        folder = save_pretrained(
            model,
            Path(workspace) / "model",
            format,
            labels=labels,
            preprocessing=preprocessing,
            report=report,
        )
        metadata = json.loads((folder / METADATA_FILE).read_text(encoding="utf-8"))
        card = model_card(model, metadata, _report(report), repo_id=repo_id)  # loading examples name the repo
        (folder / CARD_FILE).write_text(card, encoding="utf-8")
        huggingface_hub.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
        commit = huggingface_hub.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            token=token,
            commit_message=commit_message or f"Upload {model.name} ({format} format) with keras_vit",
        )
    return str(getattr(commit, "commit_url", commit))


def read_metadata(source: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> dict:
    """The `keras_vit.json` of a folder written by `save_pretrained`, or of a Hub repo `"hf-hub:org/name"`."""
    _, metadata = read_shared(source, cache_dir=cache_dir)
    if metadata is None:
        raise FileNotFoundError(_not_shared(source))
    return metadata


def _not_shared(source: str | os.PathLike) -> str:
    if isinstance(source, str) and source.startswith(HUB_PREFIX):
        return (
            f"{source} has no {METADATA_FILE}: it was not written by keras_vit. Load its weights into a "
            f"model you build: keras_vit.create_model('<variant>', pretrained={source!r})."
        )
    return (
        f"{Path(source).expanduser() / METADATA_FILE} not found: pass a folder written by "
        "keras_vit.save_pretrained (keras-vit convert --to)."
    )


def load_pretrained(
    source: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, verify: bool = True
) -> keras.Model:
    """The model a `save_pretrained` folder or a `push_to_hub` repo (`"hf-hub:org/name"`) holds, exactly.

    Built from the recorded keras_vit config (architecture, numerics, pooling, head) and
    loaded from the format's weights file, by the build-with-checkpoint step of
    `create_model(..., pretrained=)` (`keras_vit.models.build_with_checkpoint`). First the
    SHA-256 checksums `keras_vit.json` records are verified (`verify_shared`): a changed file
    is a `ChecksumError` naming it; `verify=False` loads files edited on purpose.
    """
    from keras_vit.models.build import build_with_checkpoint

    is_folder = not (isinstance(source, str) and source.startswith(HUB_PREFIX))
    if is_folder and not (Path(source).expanduser() / METADATA_FILE).is_file():
        raise FileNotFoundError(_not_shared(source))  # before reading: not a folder keras_vit wrote
    checkpoint = resolve_pretrained(source, cache_dir=cache_dir, verify=verify)
    if checkpoint.metadata is None:
        raise FileNotFoundError(_not_shared(source))
    recorded = {key: value for key, value in checkpoint.metadata["model"].items() if key != "trainable"}
    config = ViTConfig.from_dict(recorded.pop("config"))
    return build_with_checkpoint(config, checkpoint, recorded)


def _how_to_load(format: str, repo: str, head: bool) -> str:
    snippets = [
        "```python\nimport keras_vit\n\n"
        f'model = keras_vit.load_pretrained("hf-hub:{repo}")\n'
        f'metadata = keras_vit.deploy.sharing.read_metadata("hf-hub:{repo}")\n'
        'spec = keras_vit.Preprocessing(**metadata["preprocessing"])  # labels: metadata["labels"]\n'
        "```"
    ]
    if format == "timm":
        snippets.append(
            f'```python\nimport timm\n\nmodel = timm.create_model("hf-hub:{repo}", pretrained=True).eval()\n'
            "config = timm.data.resolve_data_config({}, model=model)\n"
            "transform = timm.data.create_transform(**config)\n```"
        )
    elif format == "hf":
        cls = "ViTForImageClassification" if head else "ViTModel"
        snippets.append(
            f"```python\nfrom transformers import ViTImageProcessor, {cls}\n\n"
            f'processor = ViTImageProcessor.from_pretrained("{repo}")\n'
            f'model = {cls}.from_pretrained("{repo}")\n```'
        )
    else:
        snippets.append(
            "`model.npz` has the original vision_transformer layout: JAX's `checkpoint.load`, or timm's "
            "`_load_weights(model, 'model.npz')` for a timm model of the same architecture, read it."
        )
    return "\n\n".join(snippets)


def _scalar_rows(values: Mapping) -> list[str]:
    return [
        f"| {key} | {value} |"
        for key, value in values.items()
        if isinstance(value, (int, float, str, bool)) or value is None
    ]


def model_card(
    model: keras.Model, metadata: Mapping, report: Mapping | None = None, repo_id: str | None = None
) -> str:
    """The Hub model card (`README.md`): architecture, parameters, training, preprocessing, how to load.

    `metadata` is what `save_pretrained` writes to `keras_vit.json`; `report` a training run's
    `report.json` (data, recipe, metrics), if any.
    """
    config = model.config
    format = metadata["format"]
    labels = metadata.get("labels")
    spec = metadata["preprocessing"]
    repo = repo_id or "<user>/<repo>"
    tags = [
        "image-classification" if model.head is not None else "image-feature-extraction",
        "vision-transformer",
    ]
    front = [
        "---",
        f"library_name: {FORMATS[format].library}",
        "tags:",
        *(f"- {tag}" for tag in [*tags, "keras_vit"]),
    ]
    front += [f"pipeline_tag: {tags[0]}", "---"]
    lines = [
        *front,
        "",
        f"# {model.name}",
        "",
        f"A Vision Transformer written by keras_vit {metadata.get('keras_vit_version', __version__)} in the "
        f"**{format}** format (`{metadata['weights']}`).",
        "",
        "## Architecture",
        "",
        f"- {config.description}",
        f"- input {config.image_hw[0]}x{config.image_hw[1]} px, {model.channels} channels; pooling "
        f"`{config.pooling}`, [class] token: {config.class_token}; numerics `{config.numerics}`",
        f"- head: {model.num_classes} classes"
        if model.head is not None
        else "- no classification head (features)",
        f"- parameters: {model.count_params():,}",
    ]
    if model.pretrained_tag:
        lines.append(f"- initialised from the keras_vit catalog checkpoint `{model.pretrained_tag}`")
    if report:
        lines += ["", "## Training", ""]
        data = report.get("data")
        if isinstance(data, Mapping):
            lines += ["Data:", "", "| field | value |", "|---|---|", *_scalar_rows(data), ""]
        if report.get("recipe"):
            lines += [f"Recipe: `{report['recipe']}`", ""]
        hyperparameters = report.get("hyperparameters")
        if isinstance(hyperparameters, Mapping):
            lines += [
                "Hyperparameters:",
                "",
                "| field | value |",
                "|---|---|",
                *_scalar_rows(hyperparameters),
                "",
            ]
        metrics = {
            key: report[key]
            for key in ("accuracy", "top5_accuracy", "loss", "test_examples", "steps", "seconds")
            if key in report
        }
        if metrics:
            lines += ["Metrics (held-out):", "", "| metric | value |", "|---|---|", *_scalar_rows(metrics)]
    lines += [
        "",
        "## Preprocessing",
        "",
        f"RGB, resized ({spec['interpolation']}) to {spec['image_size'][0]}x{spec['image_size'][1]}"
        + (f" after a centre crop of {spec['crop_pct']}" if spec.get("crop_pct") else "")
        + f", then `(x / 255 - mean) / std` with mean {spec['mean']} and std {spec['std']}.",
    ]
    if labels:
        shown = ", ".join(labels[:10]) + (", ..." if len(labels) > 10 else "")
        lines += [
            "",
            "## Labels",
            "",
            f"{len(labels)} classes in head order: {shown} (all in `{METADATA_FILE}`).",
        ]
    lines += ["", "## How to load", "", _how_to_load(format, repo, model.head is not None), ""]
    return "\n".join(lines)
