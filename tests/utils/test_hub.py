"""`keras_vit.utils.hub.hub_download`: a cached file is checked against its sha256, and a download
that breaks off leaves nothing a later run could take for the file."""

import hashlib
import http.server
import threading
from pathlib import Path

import huggingface_hub
import pytest
from helpers.hub_cache import FakeHub, cached_files, populate_cache

from keras_vit.utils.hub import WeightsIntegrityError, WeightsUnavailableError, hub_download

REPO = "someone/vit-test"


def test_a_cached_file_is_checked_against_its_sha256_and_deleted_when_it_differs(hub_cache):
    data = b"not really a checkpoint"
    populate_cache(hub_cache, REPO, "model.safetensors", data)
    digest = hashlib.sha256(data).hexdigest()
    for sha256 in (None, digest, digest.upper()):
        path = hub_download(REPO, "model.safetensors", sha256=sha256, label="the test file")
        assert Path(path).read_bytes() == data
    with pytest.raises(WeightsIntegrityError, match="does not have the sha256 .* for the test file"):
        hub_download(REPO, "model.safetensors", sha256="0" * 64, label="the test file")
    assert cached_files(hub_cache) == []


@pytest.mark.parametrize("truncate", [False, True], ids=["complete", "dropped-mid-body"])
def test_download_through_fake_hub_leaves_no_partial_file(tmp_path, monkeypatch, truncate):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    handler = type("Handler", (FakeHub,), {"body": bytes(range(256)) * 4096, "truncate": truncate})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    cache = tmp_path / "hub"
    try:
        download = lambda: hub_download(  # noqa: E731
            REPO,
            "model.safetensors",
            label="the test file",
            cache_dir=cache,
            endpoint=f"http://127.0.0.1:{server.server_port}",
        )
        if not truncate:
            assert Path(download()).read_bytes() == handler.body
            return
        with pytest.raises(WeightsUnavailableError, match=r"'model.safetensors'.*'someone/vit-test'"):
            download()
    finally:
        server.shutdown()
        server.server_close()
    assert cached_files(cache) == []
    assert not list(cache.rglob("*.incomplete"))
