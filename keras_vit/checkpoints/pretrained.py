"""Published ViT checkpoints: downloads from the Hugging Face Hub, and resolving `pretrained=`.

The catalog itself (the rows of `weights/catalog.json`, tags, default tags, preprocessing and
labels) is `keras_vit.registry.catalog`, pure data below everything; this module resolves a
`pretrained=` value to a `Checkpoint` (downloading it if needed; the class is
`keras_vit.checkpoints.loading`'s), which answers, once, what model fits it
(`Checkpoint.model_kwargs`). `keras_vit.models.build_with_checkpoint` builds and loads
that model for `create_model(..., pretrained=)` and `keras_vit.load_pretrained`;
`load_weights` loads into a model that exists.

* Tags are `<variant>.<pre-training>`, e.g. `vit_b16.augreg2_in21k_ft_in1k`; inside a factory
  the variant may be left out: `vit_b16(pretrained="augreg_in21k_ft_in1k")`.
* A folder written by `keras_vit.save_pretrained`, or a Hub repo (`"hf-hub:org/name"`) that
  `keras_vit.push_to_hub` wrote, has `keras_vit.json` (`read_shared`): the weights file, its
  format and the model's exact config (numerics, heads, layout).

Downloads are `keras_vit.utils.hub.hub_download`'s (the hub cache, a network check that fails
at once, sha256 checks); a cached checkpoint that turns out unreadable is deleted here before
the error is raised, so the next run downloads it again.

A model built from a tag is named after it (`model.name == "vit_b16.augreg2_in21k_ft_in1k"`
unless `name=` is given) and has `model.pretrained_tag`; the name survives `.keras` saving,
so `preprocess_input(images, model)` and `decode_predictions(preds, tag_or_model=model)`
find the checkpoint's normalisation and labels for a reloaded model too.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from huggingface_hub import try_to_load_from_cache

from keras_vit.checkpoints import (
    CheckpointError,
    CheckpointInfo,
    detect_format,
    inspect_checkpoint,
    read_checkpoint,
)
from keras_vit.checkpoints.loading import Checkpoint, read_hf_config
from keras_vit.registry import catalog
from keras_vit.registry.variants import ViTConfig, architecture, config_of, get_config, variant_for
from keras_vit.utils.defaults import METADATA_FILE
from keras_vit.utils.files import ChecksumError, file_sha256, json_sha256
from keras_vit.utils.hub import WeightsIntegrityError, WeightsUnavailableError, hub_download, remove_cached

if TYPE_CHECKING:  # no Keras import here: a pretrained= value is resolved (and refused) before Keras loads
    import keras

__all__ = [
    "Checkpoint",  # what resolve_pretrained returns (defined in checkpoints.loading)
    "WeightsIntegrityError",  # the download errors (defined in utils.hub)
    "WeightsUnavailableError",
    "checkpoint_record",
    "download_checkpoint",
    "hub_repo_files",
    "load_weights",
    "metadata_sha256",
    "read_shared",
    "resolve_pretrained",
    "verify_shared",
]
DEFAULT_FILENAME = "model.safetensors"
# `pretrained="hf-hub:org/name"`: a Hub repo, e.g. one `keras_vit.push_to_hub` wrote, whose
# `keras_vit.json` names the weights file, its format and the model's exact config.
HUB_PREFIX = "hf-hub:"
_CHECKPOINT_SUFFIXES = (".safetensors", ".npz", ".bin", ".pt", ".pth")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def download_checkpoint(
    source: str | catalog.CatalogEntry,
    *,
    cache_dir: str | os.PathLike | None = None,
    endpoint: str | None = None,
) -> str:
    """Local path of a checkpoint from the hub cache, downloaded first if missing.

    `source` is a full catalog tag, a `catalog.CatalogEntry`, or a hub repo id `"org/name"` (file
    name from the catalog, else `model.safetensors`). `cache_dir` and `endpoint` are passed to
    `huggingface_hub.hf_hub_download` (defaults: `HF_HUB_CACHE`, `HF_ENDPOINT`).
    """
    return _find(source, None, cache_dir, endpoint)[0]


def _check_fits(
    target: dict[str, int], target_name: str, stored: dict[str, int], stored_variant: str | None, label: str
) -> None:
    """A clear error, naming the factory that fits, when a checkpoint's architecture differs."""
    differences = [f"{key} {stored[key]} vs {target[key]}" for key in target if stored[key] != target[key]]
    if not differences:
        return
    if stored_variant is not None:
        hint = f"it is a {stored_variant} checkpoint: load it with keras_vit.{stored_variant}(pretrained=...)"
    else:
        hint = "no keras_vit variant has its architecture: build one with keras_vit.build_vit(ViTConfig(...))"
    raise ValueError(
        f"{label} does not fit {target_name} (checkpoint vs model: {', '.join(differences)}); {hint}."
    )


def fetch_pretrained(
    source, variant: str | None = None, *, cache_dir: str | os.PathLike | None = None
) -> None:
    """Have a `pretrained=` value's files on this machine (downloaded if missing), without reading them.

    The command line calls it before it imports the backend, so a missing network, an unknown tag or
    a missing file is one line within a second; `resolve_pretrained` then finds the files cached.
    """
    if source is not False and source is not None:
        _find(source, variant, cache_dir)


def _find(
    source, variant: str | None, cache_dir: str | os.PathLike | None, endpoint: str | None = None
) -> tuple[str, catalog.CatalogEntry | None, bool, dict | None]:
    """(weights file, catalog row or None, whether it is in the hub cache, its folder's keras_vit.json
    record or None) of a `pretrained=` value, downloaded first if needed."""
    if isinstance(source, str) and source.startswith(HUB_PREFIX):
        path, metadata = read_shared(source, variant=variant, cache_dir=cache_dir)
        return path, None, True, metadata
    if source is not True and not isinstance(source, catalog.CatalogEntry):
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(
                f"pretrained must be False, True, a tag, a file path or a hub repo id, got {source!r}."
            )
        path = os.path.expanduser(os.fspath(source))
        if os.path.isdir(path):
            weights, metadata = read_shared(path)
            return weights, None, False, metadata
        if os.path.exists(path):  # the weights file of a save_pretrained folder: that folder's record
            return path, None, False, _record_of(path)
        if not isinstance(source, str) or path.endswith(_CHECKPOINT_SUFFIXES):
            raise FileNotFoundError(
                f"No checkpoint file {path!r}. pretrained= takes True, a tag such as 'augreg_in21k_ft_in1k' "
                "(keras_vit.list_pretrained()), a local file path, or a hub repo id 'org/name'."
            )
        if "/" in source and not _REPO_ID.fullmatch(source):
            raise ValueError(
                f"pretrained={source!r} is neither a local file nor a hub repo id 'org/name' nor a tag "
                "(keras_vit.list_pretrained())."
            )
    # True, a tag or a repo id: the one catalog question (a row given is taken as it is)
    entry = source if isinstance(source, catalog.CatalogEntry) else catalog.lookup(source, variant)
    if entry is None:  # a repo the catalog does not list: its model.safetensors, unchecked
        note = f"{source!r} is no local file, so it was taken as a hub repo id. "
        path = hub_download(
            source,
            DEFAULT_FILENAME,
            label=f"checkpoint {source!r}",
            variant=variant,
            cache_dir=cache_dir,
            endpoint=endpoint,
            note=note,
        )
    else:  # the catalog row's file, sha256 checked
        path = hub_download(
            entry.hub_repo,
            entry.filename,
            sha256=entry.sha256,
            label=f"checkpoint {entry.tag!r}",
            variant=entry.variant,
            cache_dir=cache_dir,
            endpoint=endpoint,
        )
    return path, entry, True, None


def hub_repo_files(
    repo: str, *, variant: str | None = None, cache_dir: str | os.PathLike | None = None
) -> tuple[str, dict | None]:
    """(local weights path, `keras_vit.json` or None) of the Hub repo `repo`, downloaded if not cached.

    A repo written by `keras_vit.push_to_hub` has `keras_vit.json` naming its weights file and
    format; other repos give their `model.safetensors` (timm and transformers both publish it).
    A transformers repo's `config.json` is fetched beside the weights (head count, numerics).
    """
    if not _REPO_ID.fullmatch(repo):
        raise ValueError(f"{HUB_PREFIX}{repo} does not name a Hub repo: use {HUB_PREFIX}org/name.")
    download = functools.partial(
        hub_download, repo, label=f"checkpoint {HUB_PREFIX}{repo}", variant=variant, cache_dir=cache_dir
    )
    try:
        metadata_path = download(METADATA_FILE)
    except WeightsUnavailableError:
        metadata = None
    else:
        metadata = _read_metadata(metadata_path)
    filename = metadata["weights"] if metadata else DEFAULT_FILENAME
    path = download(filename)
    if (metadata or {}).get("format", "hf") == "hf":
        with contextlib.suppress(WeightsUnavailableError):
            download("config.json")
    return path, metadata


_METADATA_KEYS = {"format": str, "weights": str, "model": dict}
_MODEL_KEYS = ("config", "channels", "num_classes", "include_top", "representation_size")


def _read_metadata(path: str | os.PathLike) -> dict:
    """The contents of a `keras_vit.json`, checked: a damaged or hand-broken file is a
    `CheckpointError` naming it and the fault, never a raw `JSONDecodeError` or `KeyError`."""
    rewrite = "write the folder again with keras_vit.save_pretrained (keras-vit convert --to)"
    try:
        with open(path, encoding="utf-8") as file:
            metadata = json.load(file)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}): it is damaged; {rewrite}.") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not an object of fields; {rewrite}."
        )
    for key, kind in _METADATA_KEYS.items():
        if not isinstance(metadata.get(key), kind):
            found = "is missing" if key not in metadata else f"is a {type(metadata[key]).__name__}"
            raise CheckpointError(f"{path}: field {key!r} {found}, not a {kind.__name__}; {rewrite}.")
    weights = metadata["weights"]
    if os.path.basename(weights) != weights or weights in ("", ".", ".."):
        raise CheckpointError(
            f"{path}: field 'weights' must name a file in the same folder, got {weights!r}; {rewrite}."
        )
    arguments = metadata["model"]
    missing = [key for key in _MODEL_KEYS if key not in arguments]
    if missing:
        raise CheckpointError(f"{path}: field 'model' lacks {', '.join(map(repr, missing))}; {rewrite}.")
    try:
        ViTConfig.from_dict(arguments["config"])
    except (TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(
            f"{path}: field 'model.config' is no ViT config ({error}); {rewrite}."
        ) from None
    return metadata


def read_shared(
    source: str | os.PathLike, *, variant: str | None = None, cache_dir: str | os.PathLike | None = None
) -> tuple[str, dict | None]:
    """(weights path, `keras_vit.json` or None) of a `save_pretrained` folder or a repo `"hf-hub:org/name"`.

    The one reader of `keras_vit.json`. A folder without one gives `(folder, None)` (its
    weights file is found by `keras_vit.checkpoints.read_checkpoint`), a repo without one its
    `model.safetensors`.
    """
    if isinstance(source, str) and source.startswith(HUB_PREFIX):
        return hub_repo_files(source[len(HUB_PREFIX) :], variant=variant, cache_dir=cache_dir)
    folder = Path(source).expanduser()
    if not (folder / METADATA_FILE).is_file():
        return str(folder), None
    metadata = _read_metadata(folder / METADATA_FILE)
    return str(folder / metadata["weights"]), metadata


def _record_of(path: str) -> dict | None:
    """The `keras_vit.json` beside the file `path` when it names `path` as its weights, else `None`:
    the file of a `save_pretrained` folder is read (and verified) as the folder is."""
    record = Path(path).expanduser().parent / METADATA_FILE
    if not record.is_file():
        return None
    metadata = _read_metadata(record)
    return metadata if metadata["weights"] == os.path.basename(path) else None


def metadata_sha256(metadata: Mapping) -> str:
    """The SHA-256 of a `keras_vit.json`'s content but its own `sha256` field."""
    return json_sha256({key: value for key, value in metadata.items() if key != "sha256"})


def verify_shared(folder: str | os.PathLike, metadata: Mapping, *, complete: bool = True) -> None:
    """`ChecksumError` naming the file unless `keras_vit.json` and the files it records are as written.

    `complete`: every recorded file must be there (a local folder); else only those present
    are checked (a Hub download holds the weights, not the format's other files). Metadata
    from a keras_vit that recorded no checksums is loaded with a warning.
    """
    folder = Path(folder)
    if "sha256" not in metadata:
        warnings.warn(
            f"{folder / METADATA_FILE} records no checksums (written by an older keras_vit): its files "
            "are not verified.",
            stacklevel=3,
        )
        return
    edited = "pass verify=False (--no-verify) to load it as it is if you changed it on purpose"
    if metadata["sha256"] != metadata_sha256(metadata):
        raise ChecksumError(
            f"{folder / METADATA_FILE} does not match its recorded SHA-256 checksum: it was edited or "
            f"damaged. Write the folder again with keras_vit.save_pretrained, or {edited}."
        )
    for name, digest in (metadata.get("files") or {}).items():
        path = folder / name
        if name != os.path.basename(name):
            raise ChecksumError(
                f"{folder / METADATA_FILE} names {name!r}, which is not a file of the folder."
            )
        if not path.is_file():
            if complete:
                raise ChecksumError(f"{path} is missing: {METADATA_FILE} records it. Copy the whole folder.")
            continue
        if file_sha256(path) != digest:
            raise ChecksumError(
                f"{path} does not match the SHA-256 checksum {METADATA_FILE} records: it was changed or "
                f"damaged. Write the folder again with keras_vit.save_pretrained, or {edited}."
            )


def _shared_info(metadata: dict) -> CheckpointInfo:
    """The architecture of a checkpoint `keras_vit.save_pretrained` wrote, from its `keras_vit.json`."""
    arguments = metadata["model"]
    config = ViTConfig.from_dict(arguments["config"])
    return CheckpointInfo(
        format=metadata["format"],
        hidden_size=config.hidden_size,
        depth=config.depth,
        num_heads=config.num_heads,
        mlp_dim=config.mlp_dim,
        patch_size=config.patch_size,
        grid=config.token_grid(),
        channels=arguments["channels"],
        num_classes=arguments["num_classes"] if arguments["include_top"] else None,
        representation_size=arguments["representation_size"],
        variant=variant_for(config),
        resnet_stages=config.resnet_stages,
        class_token=config.class_token,
        pooling=config.pooling,
        fc_norm=config.fc_norm,
        numerics=config.numerics,
    )


def _read(path: str, from_hub: bool, label: str) -> dict[str, np.ndarray]:
    try:
        return read_checkpoint(path)
    except CheckpointError as error:
        if not from_hub:
            raise
        remove_cached(path)
        raise WeightsIntegrityError(
            f"The cached checkpoint for {label} ({path}) is corrupt: {error}. It was deleted from the "
            "Hugging Face cache: run again to download it anew."
        ) from error


def resolve_pretrained(
    source, variant: str | None = None, *, cache_dir: str | os.PathLike | None = None, verify: bool = True
) -> Checkpoint:
    """Find, download if needed, read and check the checkpoint a `pretrained=` value names.

    `source`: `True` (the variant's default tag), a tag (short with `variant`, or full), a
    local file (format detected), a `save_pretrained` folder, or a hub repo id (`"org/name"`,
    or `"hf-hub:org/name"`). A folder's or repo's `keras_vit.json` (also when `source` is the
    weights file it names), if any, gives the weights
    file, format, head count, numerics and layout exactly, and with `verify` the SHA-256
    checksums it records are checked before the weights are read (`verify_shared`: a changed
    file is a `ChecksumError` naming it). With `variant`, a checkpoint of another architecture
    is an error naming the factory that fits it.
    """
    path, entry, from_hub, metadata = _find(source, variant, cache_dir)
    if metadata is not None and verify:
        verify_shared(Path(path).parent, metadata, complete=not from_hub)
    label = f"checkpoint {entry.tag!r}" if entry else f"checkpoint {os.fspath(source)!r}"
    state = _read(path, from_hub, label)
    if metadata is not None:  # keras_vit.json records what the weights do not: heads, numerics, layout
        info = _shared_info(metadata)
    else:
        format = entry.format if entry else detect_format(state)
        hf_config = read_hf_config(path) if format == "hf" else None  # head count, numerics
        info = inspect_checkpoint(state, format=format, hf_config=hf_config)
    if variant is not None:
        _check_fits(architecture(get_config(variant)), variant, architecture(info), info.variant, label)
    return Checkpoint(state=state, info=info, entry=entry, label=label, metadata=metadata)


def checkpoint_record(source, model: keras.Model | None = None) -> dict | None:
    """Where a `pretrained=` value's weights came from, for run reports; `None` for no checkpoint.

    `{"source": the value as given}`, with the catalog `tag`, `hub_repo` and `filename` when the
    weights came from the hub (`model.pretrained_tag` names the tag), and the local `file`, its
    `bytes` and `sha256` when there is one (a local path, or the hub-cache copy).
    """
    if source is False or source is None:
        return None
    import keras  # a model can only be given by a caller that has imported Keras

    if isinstance(source, keras.Model):
        return {"source": f"model {source.name!r} (in memory)"}
    record = {"source": source if source is True else os.fspath(source)}
    path = None if source is True else os.path.expanduser(os.fspath(source))
    if path is None or not os.path.isfile(path):
        path = None
        entry = catalog.model_entry(model) if getattr(model, "pretrained_tag", None) else None
        if entry is not None:
            repo, filename = entry.hub_repo, entry.filename
            record["tag"] = entry.tag
        elif isinstance(source, str) and _REPO_ID.fullmatch(source):
            repo, filename = source, DEFAULT_FILENAME
        else:
            repo = filename = None
        if repo is not None:
            record.update(hub_repo=repo, filename=filename)
            cached = try_to_load_from_cache(repo, filename)
            path = cached if isinstance(cached, str) else None
    if path is not None:
        record.update(file=os.path.abspath(path), bytes=os.path.getsize(path), sha256=file_sha256(path))
    return record


def load_weights(
    model: keras.Model,
    source,
    *,
    cache_dir: str | os.PathLike | None = None,
    pos_embed_interpolation: str | None = None,
    verify: bool = True,
) -> None:
    """Load a checkpoint into an existing keras_vit model.

    `source`: a tag (a short one resolves against the model's variant), a local file or a hub
    repo id. The position embedding is resized to the model's grid (`pos_embed_interpolation`,
    default the source's: see `load_checkpoint`); a head of another class count is skipped (the
    model keeps its own); pre-logits are loaded if the model has them. The model keeps its own
    numerics (`ViTConfig.numerics`); `create_model(..., pretrained=source)` builds one with the
    source's. A catalog tag of another architecture is refused before anything is downloaded.
    A `save_pretrained` folder's checksums are verified unless `verify=False` (`resolve_pretrained`).
    """
    config = config_of(model)
    shape = architecture(config)
    variant = variant_for(config, prefer=config.name)
    is_tag = isinstance(source, str) and "." in source and "/" not in source and not os.path.exists(source)
    if variant is None and is_tag:
        entry = catalog.get_entry(source)
        stored = architecture(get_config(entry.variant))
        _check_fits(shape, model.name, stored, entry.variant, f"checkpoint {entry.tag!r}")
    checkpoint = resolve_pretrained(source, variant, cache_dir=cache_dir, verify=verify)
    info = checkpoint.info
    _check_fits(shape, model.name, architecture(info), info.variant, checkpoint.label)
    checkpoint.load_into(model, pos_embed_interpolation=pos_embed_interpolation)
