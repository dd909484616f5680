"""The install the README tells a new user to run is enough for every command.

Creates a fresh virtual environment (no system site-packages, none of the test extras) and runs
the README's install command in it exactly: ``pip install -c constraints.txt -e .`` from the
repository root. pip resolves the declared dependencies from whatever indexes and wheel caches
this machine's pip is configured with; nothing is copied from the test environment. Then, with
that environment's own ``qconvert`` executable:

* ``--help`` of the group and of every subcommand, nested groups included (``--help`` does not run
  a command's body, so it does not import what the body imports; the next two checks do);
* every module of the package is imported, and the only imports allowed to fail are the optional
  engines (vLLM, Triton, transformers: installed with vLLM) that the README installs separately;
* one real call: ``qconvert reload vllm`` against a fake vLLM dev-mode server on 127.0.0.1
  (its exit status and report line), the call that needed ``requests``, a test-only extra.

It takes about a minute with pip's cache warm (more when torch has to be downloaded): marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
OPTIONAL = {"vllm", "triton", "transformers"}

LIST_COMMANDS = """
import click, json
from qconvert.cli import main
def walk(cmd, path):
    yield path
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            yield from walk(sub, path + [name])
print(json.dumps(list(walk(main, []))))
"""

IMPORT_ALL = """
import importlib, json, pkgutil, qconvert
bad = {}
for m in pkgutil.walk_packages(qconvert.__path__, "qconvert."):
    try:
        importlib.import_module(m.name)
    except ImportError as e:
        bad[m.name] = getattr(e, "name", None) or str(e)
print(json.dumps(bad))
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fresh") / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(d)], check=True)
    r = subprocess.run(
        [str(d / "bin" / "pip"), "install", "-q", "-c", "constraints.txt", "-e", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return d


def _run(venv: Path, *args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra_env or {})
    return subprocess.run(list(args), capture_output=True, text=True, timeout=300, env=env, cwd=venv.parent)


def test_fresh_install_has_no_test_extras(venv):
    r = _run(
        venv,
        str(venv / "bin" / "python"),
        "-c",
        "import importlib.util as u; print([m for m in ('requests', 'pytest', 'hypothesis') if u.find_spec(m)])",
    )
    assert r.returncode == 0, r.stderr
    # requests may come in as some dependency's dependency; what matters is that qconvert does not need it
    assert "pytest" not in r.stdout and "hypothesis" not in r.stdout
    r = _run(venv, str(venv / "bin" / "python"), "-c", "import qconvert; print(qconvert.__file__)")
    assert r.stdout.strip() == str(REPO / "qconvert" / "__init__.py")


def test_every_subcommand_help(venv):
    r = _run(venv, str(venv / "bin" / "python"), "-c", LIST_COMMANDS)
    assert r.returncode == 0, r.stderr
    paths = json.loads(r.stdout)
    assert ["reload", "vllm"] in paths and ["stage"] in paths and len(paths) > 8
    for path in paths:
        h = _run(venv, str(venv / "bin" / "qconvert"), *path, "--help")
        assert h.returncode == 0 and h.stdout.startswith("Usage: qconvert"), (path, h.stderr[-2000:])


def test_every_module_imports(venv):
    r = _run(venv, str(venv / "bin" / "python"), "-c", IMPORT_ALL)
    assert r.returncode == 0, r.stderr
    bad = json.loads(r.stdout)
    assert {m: n for m, n in bad.items() if n.split(".")[0] not in OPTIONAL} == {}


def test_reload_vllm_real_call(venv, tmp_path):
    from test_hostile_reload import Hostile

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    save_file({"model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}, ckpt / "model.safetensors")
    srv = Hostile("vllm", {})
    try:
        r = _run(
            venv,
            str(venv / "bin" / "qconvert"),
            "reload",
            "vllm",
            srv.url,
            str(ckpt),
            "--weight-version",
            "fresh-1",
            "--timeout",
            "20",
            extra_env={"QCONVERT_STATE_DIR": str(tmp_path / "state")},
        )
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(f"vllm {srv.url}: reloaded, weight version fresh-1"), r.stdout
    assert [p for m, p in srv.calls if m == "POST"] == [
        "/pause",
        "/collective_rpc",
        "/update_weight_version",
        "/resume",
    ]
