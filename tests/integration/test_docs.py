"""The documentation site (issue 22): ``mkdocs build --strict`` passes (no broken link, missing page, unresolved
docstring reference or griffe warning), every example notebook and every API reference page is in the built
site, and the magics' help page is the help the magics ship. Built for real into a temporary folder (about
15 s on 2 cores); nothing is written into the repository (mkdocs-jupyter's cache is off in mkdocs.yml)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb") if not p.name.endswith(".out.ipynb"))
# page -> the objects mkdocstrings must have rendered there (their anchors are their full paths)
API_PAGES = {
    "distributed": ["sgpu_magic.distributed", "sgpu_magic.DistributedFunction"],
    "run_script": ["sgpu_magic.run_script"],
    "job": ["sgpu_magic.Job", "sgpu_magic.JobState", "sgpu_magic.attach", "sgpu_magic.detached_runs"],
    "runtime": ["sgpu_magic.runtime", "sgpu_magic.runtime.get_global_rank", "sgpu_magic.runtime.backend"],
    "data": ["sgpu_magic.data", "sgpu_magic.data.VolumeDataset", "sgpu_magic.data.DataLoader"],
    "checkpoint": ["sgpu_magic.checkpoint", "sgpu_magic.checkpoint.VolumeWriter", "sgpu_magic.checkpoint.VolumeReader"],
    "errors": ["sgpu_magic.errors", "sgpu_magic.errors.SgpuError", "sgpu_magic.errors.RankFailedError"],
    "testing": ["sgpu_magic.testing", "sgpu_magic.testing.start_job", "sgpu_magic.testing.mlflow_ui_pid"],
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def test_every_notebook_renders_with_its_stored_outputs(site):
    assert NOTEBOOKS, "no notebooks found"
    for stem in NOTEBOOKS:
        page = site / "notebooks" / stem / "index.html"
        assert page.is_file(), f"{stem}.ipynb has no page in the site"
        html = page.read_text()
        assert "jp-Notebook" in html, f"{stem}: not rendered by mkdocs-jupyter"
    # a stored output (a checked cell's) is on its page: the site shows outputs, it does not execute
    stored = (site / "notebooks" / "02_fsdp" / "index.html").read_text()
    assert "jp-OutputArea-output" in stored


def test_every_api_page_has_its_objects(site):
    for page, objects in API_PAGES.items():
        html = (site / "reference" / page / "index.html").read_text()
        for name in objects:
            assert f'id="{name}"' in html, f"reference/{page}: {name} was not rendered"
    assert not re.search(r":(func|class|mod|meth):<code>", (site / "reference" / "job" / "index.html").read_text())


def test_the_magics_help_page_is_the_shipped_help(site):
    from sgpu_magic.front.magic_help import MAGICS

    html = (site / "reference" / "magics" / "index.html").read_text()
    for magic in MAGICS:
        assert f"<code>{magic}</code>" in html, f"{magic} is missing from the magics' help page"
    # the usage line @magic_arguments makes from the options, and a %config trait with its help
    assert "--max-restarts" in html and "DistributedMagics.teardown_grace_s" in html


def test_every_guide_page_and_history_is_built(site):
    nav = (ROOT / "mkdocs.yml").read_text()
    for md in re.findall(r":\s*(guide/[\w-]+\.md)", nav) + ["benchmarks/history.md", "reliability.md"]:
        assert (site / md.removesuffix(".md") / "index.html").is_file(), md


def _hooks():
    spec = importlib.util.spec_from_file_location("sgpu_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_magic_the_hook_cannot_find_fails_the_build(monkeypatch):
    from sgpu_magic.front import magic_help

    monkeypatch.setitem(magic_help.MAGICS, "%distributed_nonesuch", "a magic that does not exist")
    with pytest.raises(
        RuntimeError,
        match=r"%distributed_nonesuch is in sgpu_magic\.front\.magic_help\.MAGICS but "
        r"neither DistributedMagics nor SessionMagics has a magic named 'distributed_nonesuch'",
    ):
        _hooks().on_page_markdown("# help\n\n<!-- sgpu_magic:magic-help -->\n", None, None, None)


def test_readme_is_a_landing_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_the_site_settings_make_a_broken_link_or_anchor_fail_the_build(tmp_path):
    """mkdocs.yml's own ``strict`` and ``validation`` settings, on a two-page site with a link to a missing page and
    one to a missing heading: the build fails naming both (what CI's step relies on)."""
    import yaml

    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nhooks:", 1)[0].split("\ntheme:", 1)[0])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md) and [no such heading](other.md#nowhere)\n")
    (docs / "other.md").write_text("# Other\n")
    config = {"site_name": "t", "docs_dir": "docs", "strict": settings["strict"], "validation": settings["validation"]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert re.search(r"contains a link 'missing\.md', but the target .*is not found", run.stderr)
    assert re.search(
        r"contains a link 'other\.md#nowhere', but the doc 'other\.md' does not contain an anchor "
        r"'#nowhere'",
        run.stderr,
    )
    assert "Aborted with 2 warnings in strict mode" in run.stdout + run.stderr
