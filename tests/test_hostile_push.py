"""Hostile inputs for `qconvert push`: one parametrized table.

Each row is a source README.md in DST, an environment or arguments, and what must happen. For
every row: DST is byte-identical afterwards (push never writes into DST, whether the upload
succeeds or fails), and the process never prints a traceback. A row that succeeds must give a
card whose metadata, read by huggingface_hub's own parser, holds only allowed keys with the
expected values, whose Markdown (parsed by markdown-it-py, a CommonMark parser) has only
qconvert's headings before "Original model card" and the source's front matter verbatim in one
code block, and which is stable: pushing again, and pushing from a DST whose README.md is the
card itself, upload the same bytes. A row that fails must fail with exit 1 and one error line.

A new entry point inherits the table by adding its runner beside ``_push``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from huggingface_hub import ModelCard
from markdown_it import MarkdownIt
from test_hub import LocalHub, hub  # noqa: F401  (the fixture)

from qconvert.cli import main
from qconvert.convert.pipeline import ConvertOptions, convert
from qconvert.convert.plan import PlanOptions

#: the metadata keys a qconvert card may carry (README: "Inspect, verify, publish")
ALLOWED = {
    "base_model",
    "base_model_relation",
    "library_name",
    "license",
    "license_name",
    "license_link",
    "pipeline_tag",
    "language",
    "datasets",
    "inference",
    "tags",
}
#: qconvert's own headings, in the order the card has them (some are optional)
OUR_HEADINGS = [
    "x",
    "Quantization",
    "Modules kept in BF16",
    "Size",
    "Accuracy (qconvert verify)",
    "Serving",
    "vLLM 0.33.0",
    "SGLang 0.5.23",
    "Versions",
    "License",
    "Original model card",
]
REPO = "org/x"


@pytest.fixture(scope="module")
def ck(demo_dense, tmp_path_factory):
    """A dense demo model and its MXFP8 conversion (whose README.md each row replaces)."""
    out = tmp_path_factory.mktemp("hostile-push") / "mxfp8"
    convert(
        str(demo_dense),
        out,
        "mxfp8",
        ConvertOptions(scheme="mxfp8", plan=PlanOptions(scheme="mxfp8"), progress=False, fsync=False),
    )
    return {"src": demo_dense, "dst": out}


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---- the table ------------------------------------------------------------------------------------

HUGE = "a" * 1_000_000


def _readme(text: str | bytes):
    def setup(dst: Path, tmp: Path):
        (dst / "README.md").write_bytes(text if isinstance(text, bytes) else text.encode())

    return setup


def _symlink_outside(dst: Path, tmp: Path):
    secret = tmp / "secret.md"
    secret.write_text("---\nlicense: mit\n---\nsecret text outside DST\n")
    (dst / "README.md").unlink()
    (dst / "README.md").symlink_to(secret)


def _readme_dir(dst: Path, tmp: Path):
    (dst / "README.md").unlink()
    (dst / "README.md").mkdir()
    (dst / "README.md" / "x").write_text("x")


def _readme_fifo(dst: Path, tmp: Path):
    (dst / "README.md").unlink()
    os.mkfifo(dst / "README.md")


def _readme_dangling(dst: Path, tmp: Path):
    (dst / "README.md").unlink()
    (dst / "README.md").symlink_to(dst / "missing.md")


def _dangling_link_in_dst(dst: Path, tmp: Path):
    (dst / "extra.txt").symlink_to(dst / "gone.txt")


def _no_readme(dst: Path, tmp: Path):
    (dst / "README.md").unlink()


def _shard_symlink_outside(dst: Path, tmp: Path):
    (tmp / "outside.txt").write_text("not part of DST")
    (dst / "notes.txt").symlink_to(tmp / "outside.txt")


OK = "ok"
# (id, setup, extra CLI args, env, expectation)
# expectation for OK rows: {"meta": expected subset, "absent": keys that must be absent, "log": regex on stderr}
# for error rows: a regex the single error line must match
ROWS = [
    (
        "fence_in_metadata",
        _readme("---\nlicense: mit\nnote: |\n  ```\n  # Injected heading\n  ````\n---\nbody\n"),
        [],
        {},
        {"meta": {"license": "mit"}},
    ),
    (
        "markdown_in_license_name",
        _readme(
            '---\nlicense: other\nlicense_name: "x\\n\\n# Injected\\n<!-- qconvert-source-card:begin -->"\n---\nbody\n'
        ),
        [],
        {},
        {"meta": {"license": "other"}, "absent": ["license_name"], "log": r"not carried.*license_name"},
    ),
    (
        "non_string_metadata",
        _readme(
            "---\nlicense: 123\nlicense_name: [a, b]\nlibrary_name: 5\nlanguage: {x: y}\npipeline_tag: null\n"
            "datasets: [[1]]\ninference: {parameters: 1}\n---\nbody\n"
        ),
        [],
        {},
        {
            "meta": {"library_name": "transformers"},
            "absent": ["license", "license_name", "language", "pipeline_tag", "datasets", "inference"],
        },
    ),
    (
        "tags_as_string",
        _readme("---\ntags: single\n---\nbody\n"),
        [],
        {},
        {"meta": {"tags": ["qconvert", "mxfp8", "auto", "single"]}},
    ),
    (
        "tags_mapping",
        _readme("---\ntags: {a: 1}\n---\nbody\n"),
        [],
        {},
        {"meta": {"tags": ["qconvert", "mxfp8", "auto"]}},
    ),
    (
        "tags_that_look_like_yaml",
        _readme('---\ntags:\n- "---"\n- "a\\n---\\n# Injected"\n- "..."\n- ok-tag\n---\nb\n'),
        [],
        {},
        {"meta": {"tags": ["qconvert", "mxfp8", "auto", "---", "...", "ok-tag"]}},
    ),
    (
        "second_block_in_body",
        _readme("---\nlicense: mit\n---\n---\nlicense: evil\n---\n# Body\n"),
        [],
        {},
        {"meta": {"license": "mit"}},
    ),
    (
        "non_utf8_bytes",
        _readme(b"---\nlicense: mit\n---\n\xff\xfe body \xc3\x28 end\n"),
        [],
        {},
        {"meta": {"license": "mit"}, "log": r"README.md is not UTF-8 \(first bad byte at offset 21\)"},
    ),
    ("non_utf8_in_front_matter", _readme(b"---\nlicense: mit\xff\n---\nbody\n"), [], {}, {"absent": ["license"]}),
    (
        "huge_values",
        _readme(
            "---\nlicense: mit\nlicense_name: "
            + HUGE
            + "\ntags:\n"
            + "".join(f"- t{i}\n" for i in range(10_000))
            + "language: ["
            + ", ".join(["en"] * 10_000)
            + "]\n---\nbody\n"
        ),
        [],
        {},
        {"meta": {"license": "mit"}, "absent": ["license_name", "language"], "max_tags": 64 + 3},
    ),
    (
        "our_markers_in_body",
        _readme(
            "---\nlicense: mit\n---\nbody\n<!-- qconvert-card v2 -->\n<!-- qconvert-source-card:body -->\n"
            "<!-- qconvert-source-card:end -->\n```yaml\nx\n```\n<!-- qconvert-source-card:end meta=0 body=0 -->\n"
        ),
        [],
        {},
        {"meta": {"license": "mit"}},
    ),
    (
        "unclosed_fence_and_comment_in_body",
        _readme("---\nlicense: mit\n---\n```\nunclosed\n<!-- also unclosed\n"),
        [],
        {},
        {"meta": {"license": "mit"}},
    ),
    (
        "crlf_and_bom",
        _readme("\ufeff---\r\nlicense: mit\r\ntags:\r\n- a\r\n---\r\nbody\r\nline2\r\n"),
        [],
        {},
        {"meta": {"license": "mit", "tags": ["qconvert", "mxfp8", "auto", "a"]}},
    ),
    ("invalid_yaml", _readme("---\nlicense: [unclosed\n---\nbody\n"), [], {}, {"absent": ["license"]}),
    (
        "yaml_python_tag",
        _readme("---\nlicense: !!python/object/apply:os.system ['echo pwned']\n---\nbody\n"),
        [],
        {},
        {"absent": ["license"]},
    ),
    ("yaml_bad_date", _readme("---\nlicense: mit\ndate: 2023-02-30\n---\nbody\n"), [], {}, {"absent": ["license"]}),
    ("yaml_deep_nesting", _readme("---\nx: " + "[" * 5000 + "]" * 5000 + "\n---\nbody\n"), [], {}, {}),
    ("yaml_not_a_mapping", _readme("---\n- a\n- b\n---\nbody\n"), [], {}, {}),
    (
        "yaml_alias_bomb",
        _readme(
            "---\na: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
            "c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\ntags: *c\nlicense_name: *c\n---\nbody\n"
        ),
        [],
        {},
        {"meta": {"tags": ["qconvert", "mxfp8", "auto"]}, "absent": ["license_name"]},
    ),
    (
        "license_link_javascript",
        _readme("---\nlicense: other\nlicense_link: javascript:alert(1)\n---\nb\n"),
        [],
        {},
        {"meta": {"license": "other"}, "absent": ["license_link"]},
    ),
    ("no_readme", _no_readme, [], {}, {}),
    ("readme_symlink_outside_dst", _symlink_outside, [], {}, r"README.md: a symlink to .*outside .*copy"),
    ("readme_is_a_directory", _readme_dir, [], {}, r"README.md: not a regular file"),
    ("readme_is_a_fifo", _readme_fifo, [], {}, r"README.md: not a regular file"),
    ("readme_dangling_symlink", _readme_dangling, [], {}, r"README.md: cannot be read \(No such file"),
    ("dangling_symlink_in_dst", _dangling_link_in_dst, [], {}, r"extra.txt: cannot be read \(No such file"),
    ("file_symlink_outside_dst", _shard_symlink_outside, [], {}, r"notes.txt: a symlink to .*outside .*copy"),
    (
        "unreachable_endpoint",
        _readme("# card\n"),
        [],
        {"HF_ENDPOINT": "closed"},
        r"^error: org/x: upload failed: cannot reach the Hub at http://127\.0\.0\.1:\d+ \(ConnectError: .*\); check the "
        r"network and HF_ENDPOINT; .* was not changed, re-run push to resume$",
    ),
    ("hf_hub_offline", _readme("# card\n"), [], {"HF_HUB_OFFLINE": "1"}, r"HF_HUB_OFFLINE is set.*unset it"),
    (
        "server_500_with_escapes",
        _readme("# card\n"),
        [],
        {"fail": ("commit", 500, {"error": "boom\n\x1b[32mOK pushed\x1b[0m"})},
        r"answered HTTP 500 \(boom\); re-run later",
    ),
    (
        "server_401",
        _readme("# card\n"),
        [],
        {"fail": ("create", 401, {"error": "Invalid credentials"})},
        r"answered HTTP 401 \(Invalid credentials\); check HF_TOKEN",
    ),
    (
        "base_model_with_markdown",
        _readme("# card\n"),
        ["--base-model", "a/b)\n# Injected"],
        {},
        r"not a Hub model id for --base-model",
    ),
    ("revision_with_flags", _readme("# card\n"), ["--revision", "v1 --trust-remote-code"], {}, r"not a branch name"),
    ("repo_id_path", _readme("# card\n"), [], {"repo": "org/.."}, r"not a Hub repo id"),
]


def _snapshot(d: Path) -> dict:
    out = {}
    for p in [d, *sorted(d.rglob("*"))]:
        st = os.lstat(p)
        key = p.relative_to(d).as_posix()
        if stat.S_ISLNK(st.st_mode):
            out[key] = ("link", os.readlink(p))
        elif stat.S_ISREG(st.st_mode):
            out[key] = ("file", p.read_bytes(), st.st_mode)
        else:
            out[key] = ("other", st.st_mode)
    return out


def _push(dst: Path, src: Path, args: list[str], repo: str = REPO):
    r = CliRunner().invoke(main, ["push", str(dst), repo, "--src", str(src), "--no-progress", *args])
    return r.exit_code, r.stdout, r.stderr, r.exception


def _front_raw(text: str) -> str:
    """The source's front matter as the Hub reads it (huggingface_hub's pattern)."""
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    m = REGEX_YAML_BLOCK.search(text.lstrip("\ufeff"))
    return m.group(2) if m else ""


def _check_card(card: str, source: str, exp: dict):
    # metadata, as huggingface_hub parses it
    meta = ModelCard(card).data.to_dict()
    assert set(meta) <= ALLOWED, set(meta) - ALLOWED
    for k, v in exp.get("meta", {}).items():
        assert meta.get(k) == v, (k, meta.get(k))
    for k in exp.get("absent", []):
        assert k not in meta, (k, str(meta.get(k))[:200])
    assert meta["tags"][:3] == ["qconvert", "mxfp8", "auto"] and len(meta["tags"]) <= exp.get("max_tags", 64 + 3)
    assert len(yaml.safe_dump(meta)) < 10_000
    # Markdown: only our headings before the source card; the source front matter in one code block
    tokens = MarkdownIt("commonmark").parse(card)
    heads = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    ours = heads[: heads.index("Original model card") + 1] if "Original model card" in heads else heads
    assert ours == [h for h in OUR_HEADINGS if h in ours], heads[:20]
    raw = _front_raw(source)
    if raw:
        fences = [t for t in tokens if t.type == "fence" and t.info == "yaml"]
        # CommonMark reads CR LF and CR as line endings (and markdown-it gives them as LF)
        want = re.sub(r"\r\n?", "\n", raw) + "\n"
        assert fences and fences[0].content == want, fences[0].content[:300] if fences else None


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_push_hostile(row, ck, tmp_path, hub, monkeypatch):  # noqa: F811
    name, setup, args, env, expect = row
    dst = Path(shutil.copytree(ck["dst"], tmp_path / "dst", symlinks=True))
    setup(dst, tmp_path)
    source = (
        (dst / "README.md").read_bytes().decode("utf-8", "replace")
        if (dst / "README.md").is_file() and not (dst / "README.md").is_symlink()
        else ""
    )
    repo = env.get("repo", REPO)
    if env.get("HF_ENDPOINT") == "closed":
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    if "HF_HUB_OFFLINE" in env:
        import huggingface_hub.constants as c

        monkeypatch.setenv("HF_HUB_OFFLINE", env["HF_HUB_OFFLINE"])
        monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    if "fail" in env:
        route, code, body = env["fail"]
        hub.fail[route] = (code, body)
    before = _snapshot(dst)

    rc, out, err, exc = _push(dst, ck["src"], args, repo)

    assert "Traceback" not in out + err
    assert exc is None or isinstance(exc, SystemExit), repr(exc)
    assert _snapshot(dst) == before, "push changed DST"
    if isinstance(expect, str):
        assert rc == 1, (rc, out, err[-2000:], exc)
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err[-2000:]
        assert re.search(expect, errors[0]), errors[0]
        assert "\x1b" not in errors[0]
        if name != "hf_hub_offline":
            assert "HF_HUB_OFFLINE" not in errors[0]
        assert not hub.commits
        return
    assert rc == 0, (rc, out, err[-3000:], exc)
    if "log" in expect:
        assert re.search(expect["log"], err), err[-2000:]
    files = hub.repos[REPO]["branches"]["main"]
    card = files["README.md"].decode("utf-8")
    _check_card(card, source, expect)
    assert "qconvert-verify.json" in files and not (dst / "qconvert-verify.json").exists()

    # stable: a second push uploads the same card; a DST holding the card (as the Hub has it) too
    rc2, _, err2, _ = _push(dst, ck["src"], args)
    assert rc2 == 0, err2[-2000:]
    assert hub.repos[REPO]["branches"]["main"]["README.md"] == files["README.md"]
    again = Path(shutil.copytree(dst, tmp_path / "again", symlinks=True))
    if (again / "README.md").exists() or (again / "README.md").is_symlink():
        (again / "README.md").unlink()
    (again / "README.md").write_bytes(files["README.md"])
    rc3, _, err3, _ = _push(again, ck["src"], args)
    assert rc3 == 0, err3[-2000:]
    assert hub.repos[REPO]["branches"]["main"]["README.md"] == files["README.md"]


def test_push_unreachable_endpoint_subprocess(ck, tmp_path):
    """The CLI as a user runs it: HF_ENDPOINT on a closed port. One error line, exit 1, DST unchanged."""
    dst = Path(shutil.copytree(ck["dst"], tmp_path / "dst"))
    (dst / "README.md").write_text("---\nlicense: mit\n---\n# Source card\n")
    before = _snapshot(dst)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_TOKEN="hf_test_token", HF_HUB_DISABLE_XET="1")
    p = subprocess.run(
        [sys.executable, "-m", "qconvert.cli", "push", str(dst), "org/x", "--src", str(ck["src"]), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    last = p.stderr.splitlines()[-1]
    assert re.fullmatch(
        r"error: org/x: upload failed: cannot reach the Hub at http://127\.0\.0\.1:\d+ \(ConnectError: "
        r".*\); check the network and HF_ENDPOINT; .*dst was not changed, re-run push to resume",
        last,
    ), last
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("error:")] == [last]
    assert "HF_HUB_OFFLINE" not in p.stderr
    assert _snapshot(dst) == before
