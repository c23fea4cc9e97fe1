"""The documentation: the site builds with `mkdocs build --strict` (which also resolves every internal
link and anchor), the README's links resolve, and every code block of README.md and docs/*.md runs.

Each page's `python` and `bash` blocks run in document order in one fresh process per page (python
blocks share one namespace, as in a notebook; bash blocks run in a shell there), in an empty
temporary folder holding `cat.jpg` (scikit-image's cat photo) and with a fake Hugging Face Hub
cache, offline, whose checkpoints are random-weight ViT-Ti/16s. A block that cannot run so says why
in a comment on the line above it: `<!-- not-run: reason -->`, or `<!-- run-by: tests/FILE.py::TEST -->`
when another test runs it with a set-up of its own. `text` blocks are not code.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_LANGUAGES = ("python", "bash")
MARKER = re.compile(r"<!-- (not-run|run-by): (\S.*?) -->")
# The hub repos whose checkpoints the pages load (random ViT-Ti/16s with these heads).
FAKE_HUB = {
    "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k": 1000,  # vit_ti16's default tag
    "timm/vit_tiny_patch16_224.augreg_in21k": 21843,
}
PAGE_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    source: str
    marker: tuple[str, str] | None  # (kind, reason) from the comment just above the fence

    @property
    def runs(self) -> bool:
        return self.language in RUN_LANGUAGES and not self.marker

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, each with the marker comment right above it, if any."""
    lines = page.read_text().split("\n")
    blocks, index = [], 0
    while index < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[index])
        if not opening:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        above = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = MARKER.fullmatch(above.strip())
        source = "\n".join(lines[index + 1 : end]) + "\n"
        blocks.append(Block(page, index + 1, opening[1], source, marker.groups() if marker else None))
        index = end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in code_blocks(page)]
RUN_PAGES = [page for page in PAGES if any(block.page == page and block.runs for block in ALL_BLOCKS)]


def test_every_block_is_run_or_says_why():
    """Code blocks are python, bash or text; a marker gives a reason, or names a test that exists."""
    problems = []
    for block in ALL_BLOCKS:
        if block.language not in (*RUN_LANGUAGES, "text"):
            problems.append(f"{block.where}: give the block a language: python, bash or text")
        if block.marker and block.language == "text":
            problems.append(f"{block.where}: a text block is not run, it needs no marker")
        if block.marker and block.marker[0] == "run-by":
            path, _, name = block.marker[1].partition("::")
            test_file = REPO / path
            if not (
                test_file.is_file() and re.search(rf"^def {re.escape(name)}\(", test_file.read_text(), re.M)
            ):
                problems.append(f"{block.where}: run-by names {block.marker[1]}, which does not exist")
    assert not problems, "\n".join(problems)


def _slug(heading: str) -> str:
    """Python-Markdown's toc anchor for a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_links_resolve():
    """README.md is outside the site, so mkdocs does not check it: its relative links and anchors here."""
    readme = (REPO / "README.md").read_text()
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = REPO / path if path else REPO / "README.md"
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}:
            problems.append(f"{target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def test_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: any warning fails it (broken links and anchors, pages left out of the
    nav, docstrings the API reference cannot read)."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()


# ---------------------------------------------------------------- running the pages

MAKE_FAKE_HUB = """
import hashlib, os, sys
from pathlib import Path

import keras_vit

cache, commit = Path(sys.argv[1]), "0123456789abcdef0123456789abcdef01234567"
for repo, num_classes in {repos!r}.items():
    folder = cache.parent / "written" / repo.replace("/", "--")
    keras_vit.save_pretrained(keras_vit.vit_ti16(num_classes=num_classes), folder, format="timm")
    data = (folder / "model.safetensors").read_bytes()
    root = cache / ("models--" + repo.replace("/", "--"))
    blob = root / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    link = root / "snapshots" / commit / "model.safetensors"
    link.parent.mkdir(parents=True)
    link.symlink_to(Path("..", "..", "blobs", blob.name))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)

from PIL import Image
from skimage import data

Image.fromarray(data.chelsea()).save(cache.parent / "cat.jpg", quality=95)
"""

RUN_PAGE = """
import subprocess
import sys

BLOCKS = {blocks!r}
namespace = {{"__name__": "__main__"}}
for page, line, language, source in BLOCKS:
    print(f"----- {{page}}:{{line}} ({{language}})", flush=True)
    if language == "python":  # the page's line numbers in tracebacks
        exec(compile("\\n" * line + source, page, "exec"), namespace)
    else:
        subprocess.run(["bash", "-euo", "pipefail", "-c", source], check=True)
    sys.stdout.flush()
"""


def _environment(root: Path) -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]]),  # this checkout's keras-vit
        HF_HOME=str(root / "hf_home"),
        HF_HUB_CACHE=str(root / "hub"),
        HF_HUB_OFFLINE="1",
        TF_CPP_MIN_LOG_LEVEL="3",
        MPLBACKEND="Agg",
        NO_MKDOCS_2_WARNING="1",
    )
    return env


@pytest.fixture(scope="session")
def fake_hub(tmp_path_factory) -> Path:
    """A hub cache with the pages' checkpoints, and cat.jpg beside it (built once per test process)."""
    root = tmp_path_factory.mktemp("docs_hub")
    script = MAKE_FAKE_HUB.format(repos=FAKE_HUB)
    result = subprocess.run(
        [sys.executable, "-c", script, str(root / "hub")],
        env=_environment(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root


@pytest.mark.slow  # 10-80 s a page: TensorFlow in a fresh process, models built, small fits
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_page_code_runs(page, fake_hub, tmp_path):
    """The page's unmarked python and bash blocks run as written, in order, offline."""
    blocks = [
        (str(b.page.relative_to(REPO)), b.line, b.language, b.source)
        for b in ALL_BLOCKS
        if b.page == page and b.runs
    ]
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(fake_hub / "cat.jpg", work / "cat.jpg")
    script = tmp_path / "run_page.py"
    script.write_text(textwrap.dedent(RUN_PAGE.format(blocks=blocks)))
    env = _environment(fake_hub)
    env["HF_HOME"] = str(tmp_path / "hf_home")
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )
    assert result.returncode == 0, f"{page.name}:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
