"""A Hugging Face Hub cache and a hub laid out by hand: what the download tests read and serve."""

import hashlib
import http.server
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_cache(cache: Path, repo: str, filename: str, data: bytes) -> Path:
    """Lay out a file as huggingface_hub caches it: a blob, a snapshot symlink, refs/main."""
    root = cache / f"models--{repo.replace('/', '--')}"
    blob = root / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    link = root / "snapshots" / COMMIT / filename
    link.parent.mkdir(parents=True)
    link.symlink_to(Path("..", "..", "blobs", blob.name))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return link


def cached_files(cache: Path) -> list[str]:
    """Files under blobs/ and snapshots/: what a later run could take for a checkpoint."""
    return sorted(
        str(path.relative_to(cache))
        for path in cache.rglob("*")
        if (path.is_file() or path.is_symlink()) and {"blobs", "snapshots"} & set(path.parts)
    )


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Serves one file like the hub's /resolve/ endpoint. With `truncate`, the first GET drops
    the connection half-way through the body and the client's retry gets a 500."""

    body = b""
    truncate = False
    gets = 0

    def _headers(self, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(self.body).hexdigest()}"')
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()

    def do_HEAD(self):  # noqa: N802 (http.server's naming)
        self._headers()

    def do_GET(self):  # noqa: N802
        type(self).gets += 1
        if self.truncate and self.gets > 1:
            self.send_error(500)
            return
        self._headers()
        self.wfile.write(self.body[: len(self.body) // 2] if self.truncate else self.body)
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args):
        pass
