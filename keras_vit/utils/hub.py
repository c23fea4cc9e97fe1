"""One file from the Hugging Face Hub: cached, checked, and refused at once without a network.

`hub_download` goes through `huggingface_hub.hf_hub_download` (its cache `HF_HUB_CACHE`, its
progress bar, `HF_HUB_OFFLINE=1` for cached files only). A file not in the cache is first checked
for a network: a TCP connection to the hub's host (or the proxy) must open within
`HUB_PROBE_SECONDS`, else the error comes at once instead of after huggingface_hub's ~25 s of
retries. A failure raises `WeightsUnavailableError` naming the repo and file, the cache, and how to
load a local file instead (command line and Python). A cached file that turns out corrupt (a wrong
sha256 here; unreadable, in `keras_vit.checkpoints.pretrained`) is deleted before the error is
raised, so the next run downloads it again instead of trusting it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.parse
import urllib.request

from huggingface_hub import constants as hub_constants
from huggingface_hub import hf_hub_download, try_to_load_from_cache

from keras_vit.utils.files import file_sha256

__all__ = [
    "HUB_PROBE_SECONDS",
    "WeightsIntegrityError",
    "WeightsUnavailableError",
    "hub_download",
    "remove_cached",
]
# How long a TCP connection to the hub may take before the machine counts as offline.
HUB_PROBE_SECONDS = 1.5


def _local_hint(variant: str | None, cache_dir: str | os.PathLike | None = None) -> str:
    """How to do without the download: a local copy (command line and Python), the cache, offline mode."""
    build = f"keras_vit.{variant}(" if variant else "keras_vit.create_model('<variant>', "
    cache = os.fspath(cache_dir) if cache_dir is not None else hub_constants.HF_HUB_CACHE
    return (
        "To use a checkpoint file you already have, pass its path: on the command line "
        "`--weights /path/to/model.safetensors` (`--pretrained /path/to/model.safetensors` for "
        f"train/finetune), in Python {build}pretrained='/path/to/model.safetensors') or "
        "keras_vit.load_weights(model, '/path/to/model.safetensors'). Downloaded files are cached in "
        f"{cache} (HF_HUB_CACHE) and used from there without network"
        + (
            " (HF_HUB_OFFLINE is set: only those are used)."
            if hub_constants.HF_HUB_OFFLINE
            else "; set HF_HUB_OFFLINE=1 to use only cached files and never wait for the network."
        )
    )


def _probe_target(endpoint: str | None) -> tuple[str, int, str]:
    """`(host, port, what)`: where a download from `endpoint` connects first (the proxy, if one is set)."""
    url = urllib.parse.urlsplit(endpoint or hub_constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme) or urllib.request.getproxies().get("all")
    if proxy and not urllib.request.proxy_bypass(host):
        proxy_url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return proxy_url.hostname or "", proxy_url.port or 80, f"the proxy {proxy_url.hostname}"
    return host, port, host


def _hub_unreachable(endpoint: str | None, timeout: float = HUB_PROBE_SECONDS) -> str | None:
    """`None` if a TCP connection to the hub (or its proxy) opens within `timeout` s, else why not.

    Name resolution has no timeout of its own, so the attempt runs in a daemon thread that is
    waited for at most `timeout` seconds.
    """
    host, port, what = _probe_target(endpoint)
    outcome: dict[str, str] = {}

    def connect():
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome["ok"] = ""
        except OSError as error:
            outcome["error"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=connect, name="keras_vit-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if "ok" in outcome:
        return None
    reason = outcome.get("error", f"no answer within {timeout:g} s")
    return f"no network connection to {what} (port {port}: {reason})"


class WeightsUnavailableError(OSError):
    """A checkpoint could not be obtained: no network, offline cache miss, or unknown repo/file."""


class WeightsIntegrityError(WeightsUnavailableError):
    """A downloaded or cached checkpoint is corrupt (truncated, wrong sha256); it was deleted."""


def remove_cached(path: str) -> None:
    """Delete a hub-cache file: the snapshot entry and the blob it links to."""
    for target in {os.path.realpath(path), path}:
        with contextlib.suppress(FileNotFoundError):
            os.remove(target)


def hub_download(
    repo: str,
    filename: str,
    *,
    sha256: str | None = None,
    label: str,
    variant: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    endpoint: str | None = None,
    note: str = "",
) -> str:
    """Local path of `filename` of the hub repo `repo`, downloaded if not cached.

    `sha256`, when given, must match (else the file is deleted: `WeightsIntegrityError`);
    `label` names the checkpoint in errors, `variant` the factory in the hint, `note` starts them.
    """
    where = f"{note}Could not get {filename!r} from the Hugging Face Hub repo {repo!r} for {label}"
    if not hub_constants.HF_HUB_OFFLINE and not isinstance(
        try_to_load_from_cache(repo, filename, cache_dir=cache_dir), str
    ):  # not cached: fail at once without a network, instead of after ~25 s of retries
        unreachable = _hub_unreachable(endpoint)
        if unreachable is not None:
            raise WeightsUnavailableError(
                f"{where}: {unreachable}. Check the network. {_local_hint(variant, cache_dir)}"
            )
    try:
        path = hf_hub_download(repo, filename, cache_dir=cache_dir, endpoint=endpoint)
    except Exception as error:  # the transport's errors differ between huggingface_hub versions
        if hub_constants.HF_HUB_OFFLINE:
            reason = "HF_HUB_OFFLINE is set, so only cached files count, and this one is not in the cache"
        else:
            reason = f"{type(error).__name__}: {' '.join(str(error).split()).rstrip('.')}. Check the network"
        raise WeightsUnavailableError(f"{where}: {reason}. {_local_hint(variant, cache_dir)}") from error
    if sha256 and file_sha256(path) != sha256.lower():
        remove_cached(path)
        raise WeightsIntegrityError(
            f"{filename!r} from {repo!r} does not have the sha256 recorded for {label} "
            f"({sha256}); the file was deleted from the cache: run again to download it anew."
        )
    return path
