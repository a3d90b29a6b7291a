"""Every code snippet of README.md and docs/ runs, against a real daemon, as a reader would run
it; README's quick start runs verbatim; the docs site builds with broken links failing it.

A snippet may be preceded by one HTML comment the reader does not see:

* ``<!-- docs-test: prelude: NAME -->``: run after :data:`PRELUDES` ``[NAME]`` (the names a
  snippet assumes, such as a LightningModule), and before its epilogue;
* ``<!-- docs-test: skip: REASON -->``: not run here (a framework on a process group, say);
  the reason names the tests that do run it. Keep these few (:data:`MAX_SKIPS`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO as ROOT
from tests.helpers import wait_until

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAX_SKIPS = 6

_BLOCK = re.compile(
    r"(?:<!-- docs-test: (?P<mark>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```$",
    re.S | re.M,
)

PRELUDES: dict[str, tuple[str, str]] = {
    "lightning": (
        """
import lightning
import torch


class Model(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=4)


model = Model()
""",
        "",
    ),
    "data": (
        """
import os
import uuid

import torch

os.environ["SLURM_JOB_ID"] = f"docs-{uuid.uuid4().hex[:8]}"
tp_group = None  # one process: it is the loading rank


def make_my_dataloader():
    return torch.utils.data.DataLoader(torch.arange(32.0).reshape(16, 2), batch_size=4)


ckpt = {"data": {"epoch": 0, "step": 1}}  # a checkpoint saved after one batch
""",
        """
assert ckpt["data"]["step"] == 4, ckpt  # resumed after batch 1, ran to the epoch's end
train_loader.close()
""",
    ),
}


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    lang: str
    code: str
    mark: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(lang: str = "python") -> list[Snippet]:
    """Every ``lang`` fence of README.md and docs/, in page order."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            if m["lang"] == lang:
                line = text.count("\n", 0, m.start("code"))
                out.append(Snippet(page, line, lang, m["code"], (m["mark"] or "").strip()))
    return out


def _env(socket: str) -> dict[str, str]:
    return {**os.environ, "CKPTCACHE_SOCKET": socket,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip


RUNNABLE = [s for s in snippets() if not s.mark.startswith("skip:")]


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.id for s in RUNNABLE])
def test_snippet_runs(snippet, daemon_factory, tmp_path):
    """Run in a fresh directory, against a root daemon with its defaults persisting under
    that directory (relative paths in the snippets land there)."""
    work = tmp_path / "work"
    work.mkdir()
    d = daemon_factory("--memory-limit", "512MiB", "--persist-root", str(work), defaults=True)
    before, after = "", ""
    if snippet.mark:
        kind, _, name = snippet.mark.partition(":")
        assert kind == "prelude" and name.strip() in PRELUDES, snippet.mark
        before, after = PRELUDES[name.strip()]
    script = work / "snippet.py"
    script.write_text(f"{before}\n{snippet.code}\n{after}")
    out = subprocess.run([sys.executable, str(script)], cwd=work, env=_env(d.socket),
                         capture_output=True, text=True, timeout=280)  # fmt: skip
    assert out.returncode == 0, f"{snippet.id}\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr


def test_skips_are_few_and_say_why():
    skipped = [s for s in snippets() if s.mark.startswith("skip:")]
    assert len(skipped) <= MAX_SKIPS, [s.id for s in skipped]
    for s in skipped:
        # Where it does run: a folder or file of the suite that exists (a stale path after
        # tests move would send a reader nowhere).
        where = re.search(r"run by (tests/\S*)", s.mark)
        assert where is not None, (s.id, s.mark)
        assert (ROOT / where[1]).exists(), (s.id, where[1])


def _quick_start() -> list[Snippet]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = [Snippet(ROOT / "README.md", 0, m["lang"], m["code"], "")
              for m in _BLOCK.finditer(section)]  # fmt: skip
    assert [b.lang for b in blocks] == ["bash", "python", "bash"]
    return blocks


def test_readme_quick_start_runs_verbatim(tmp_path):
    """The three blocks of README's quick start, as written, in a fresh directory: a daemon
    started with persistence, a save that is on storage once wait() returns, the CLI."""
    start, save, look = _quick_start()
    socket = str(tmp_path / "daemon.sock")
    shm = f"/dev/shm/ckptcache-test-{uuid.uuid4().hex[:10]}"
    env = {**_env(socket), "CKPTCACHE_SHM_DIR": shm}
    log = tmp_path / "daemon.log"
    pid = None
    try:
        with open(log, "wb") as f:  # the daemon outlives the shell: not a pipe we wait on
            subprocess.run(["bash", "-ec", start.code], cwd=tmp_path, env=env, stdout=f,
                           stderr=f, check=True, timeout=60)  # fmt: skip
        wait_until(lambda: os.path.exists(socket), 60, "the daemon's socket")
        status = subprocess.run([sys.executable, "-m", "ckptcache.cli", "status", "--json"],
                                env=env, capture_output=True, text=True, check=True)  # fmt: skip
        pid = json.loads(status.stdout)["daemon"]["pid"]
        (tmp_path / "quick.py").write_text(save.code)
        ran = subprocess.run([sys.executable, "quick.py"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.strip() == "100"
        saved = tmp_path / "ckpt" / "run1" / "step_100.pt"
        assert saved.is_file()  # on storage once wait() returned
        shown = subprocess.run(["bash", "-ec", look.code], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert str(saved) in shown.stdout and "persisted" in shown.stdout
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 30, "the daemon to stop")
        shutil.rmtree(shm, ignore_errors=True)


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(config), "-d", str(site)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as ``mkdocs build --strict`` writes it from the repository's docs."""
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("docs") / "site"
    built = _build(ROOT / "mkdocs.yml", out)
    assert built.returncode == 0, built.stderr
    return out


# An asset a page loads: <script src=...>, <link href=...> (stylesheets, preconnects, icons).
_ASSET = re.compile(r"<(?:script|link)\b[^>]*?\b(?:src|href)=[\"']?([^\"'\s>]+)", re.I)


def test_docs_site_loads_nothing_from_another_host(site):
    """The site works offline: no page loads a script, style or font from elsewhere, and the
    diagrams are drawn by the bundled Mermaid (with its licence beside it)."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    remote = [(str(p.relative_to(site)), url) for p in pages
              for url in _ASSET.findall(p.read_text()) if re.match(r"(?:[a-z]+:)?//", url, re.I)]  # fmt: skip
    assert remote == []
    bundled = site / "assets" / "mermaid"
    assert (bundled / "mermaid.min.js").read_text().rstrip().endswith('globalThis["mermaid"] = '
                                                               'globalThis.__esbuild_esm_mermaid_nm["mermaid"].default;')  # fmt: skip
    assert "MIT License" in (bundled / "LICENSE").read_text()
    # Every ```mermaid fence of docs/ is a diagram on its page, on a page that loads the script.
    fences = sum(p.read_text().count("```mermaid\n") for p in (ROOT / "docs").rglob("*.md"))
    drawn = 0
    for page in pages:
        text = page.read_text()
        if 'class="mermaid"' in text:
            drawn += text.count('class="mermaid"')
            scripts = _ASSET.findall(text)
            assert any(u.endswith("assets/mermaid/mermaid.min.js") for u in scripts), page
    assert fences >= 5 and drawn == fences


def test_docs_site_has_a_generated_api_reference(site):
    """docs/reference.md is rendered from the docstrings: each public name has its entry."""
    page = (site / "reference" / "index.html").read_text()
    for name in ("ckptcache.save", "ckptcache.load", "ckptcache.Client", "ckptcache.Client.stage",
                 "ckptcache.errors.CkptCacheError", "ckptcache.adapters.dcp"):  # fmt: skip
        assert f'id="{name}"' in page, name
    assert ":func:`" not in page and ":class:`" not in page  # the reST roles were converted


def test_docs_site_builds_and_a_broken_link_fails_it(site, tmp_path):
    assert (site / "adapters" / "dcp" / "index.html").is_file()
    for broken, said in (
        ("[gone](no-such-page.md)", "not found among documentation files"),
        ("[gone](api.md#no-such-anchor)", "does not contain an anchor"),
    ):
        copy = tmp_path / f"copy-{uuid.uuid4().hex[:6]}"
        shutil.copytree(ROOT / "docs", copy / "docs")
        shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
        with open(copy / "docs" / "index.md", "a") as f:
            f.write(f"\n{broken}\n")
        bad = _build(copy / "mkdocs.yml", copy / "site")
        assert bad.returncode != 0 and said in bad.stderr, (broken, bad.stderr)
