"""scripts/check_doc_citations.py: docs citations and their anchors, on a made-up tree and on this one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_doc_citations.py"


@pytest.fixture(scope="module")
def cdc():
    spec = importlib.util.spec_from_file_location("check_doc_citations", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "heading, anchor",
    [
        # anchors as GitHub renders them for these headings of this repository's Markdown
        ("Why `auto` loads in both", "why-auto-loads-in-both"),
        (
            "Kernel run (2026-12-04): NVFP4 kernel, both recipes above 70 %",
            "kernel-run-2026-12-04-nvfp4-kernel-both-recipes-above-70-",
        ),
        (
            "Latest whole-conversion runs (2026-12-03, late): page-locked staging for `--device cuda`",
            "latest-whole-conversion-runs-2026-12-03-late-page-locked-staging-for---device-cuda",
        ),
        ("vLLM reload_weights", "vllm-reload_weights"),
        ("Scale swizzle 128x4", "scale-swizzle-128x4"),
        ("See [the table](x.md#y) here", "see-the-table-here"),
    ],
)
def test_slug(cdc, heading, anchor):
    assert cdc.slug(heading) == anchor


def _tree(tmp_path: Path, code: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "formats.md").write_text(
        "# Formats\n\n## MXFP8 scale rule\n\n```\n## not a heading\n```\n\n## Repeat\n\n## Repeat\n"
        '<a id="explicit"></a>\n\nSee [layouts](layouts.md#missing) and [here](#repeat-1).\n'
    )
    (tmp_path / "qconvert").mkdir()
    (tmp_path / "qconvert" / "m.py").write_text(code)
    (tmp_path / "README.md").write_text("[docs](docs/formats.md#mxfp8-scale-rule) [web](https://example.org/a.md#b)\n")
    return tmp_path


def test_reports_each_broken_citation_once(cdc, tmp_path):
    root = _tree(
        tmp_path,
        (
            '"""Rule (docs/formats.md#mxfp8-scale-rule), repeat (docs/formats.md#repeat-1), id (docs/formats.md#explicit).\n'
            "Bad anchor docs/formats.md#not-a-heading; fenced docs/formats.md#not-a-heading-1; no file docs/nope.md.\n"
            'Old note formats.md §3.4 and a bare mark §5.4; fine: BENCHMARKS.md."""\n'
        ),
    )
    got = cdc.check(root)
    assert got == [
        "qconvert/m.py:2: docs/formats.md#not-a-heading: no heading with anchor #not-a-heading in docs/formats.md",
        "qconvert/m.py:2: docs/formats.md#not-a-heading-1: no heading with anchor #not-a-heading-1 in docs/formats.md",
        "qconvert/m.py:2: docs/nope.md: no such file",
        "qconvert/m.py:3: formats.md §3.4: cites a note outside the repository; cite docs/formats.md#<anchor>",
        "qconvert/m.py:3: §5.4: a section mark of notes outside the repository; cite docs/NAME.md#<anchor>",
        "docs/formats.md:14: layouts.md#missing: no such file",
    ]


def test_exit_status_and_apply(tmp_path):
    root = _tree(tmp_path, "# see formats.md §3 here\n# and §3.3 there\n")
    (root / "docs" / "layouts.md").write_text("# Layouts\n\n## Missing\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 2, r.stdout
    table = root / "cit.tsv"
    # line numbers off by one (the file moved): placed by the text's only occurrence
    table.write_text(
        "file\tline\told\tnew\n"
        "qconvert/m.py\t2\tformats.md §3\tdocs/formats.md#mxfp8-scale-rule\n"
        "qconvert/m.py\t9\t§3.3\tdocs/formats.md#repeat\n"
    )
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), "--apply", str(table)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout
    assert (root / "qconvert" / "m.py").read_text() == (
        "# see docs/formats.md#mxfp8-scale-rule here\n# and docs/formats.md#repeat there\n"
    )


def test_this_repository_cites_only_what_exists(cdc):
    """Every citation of docs/ in the code, tests, scripts and Markdown names a file and heading that
    exist, and nothing cites the research notes outside the repository (also a lint step of .ci/run)."""
    assert cdc.check(ROOT) == []
