"""Each flag of the ``qconvert`` commands has one meaning wherever it appears (declared once in
``qconvert/cli/options.py``), and the demo command validates ``--last-n-bf16`` as convert does."""

from __future__ import annotations

from collections import defaultdict

import click
import pytest
from click.testing import CliRunner

from qconvert.cli import main

#: flags whose choices are per command (the same meaning, the values each command offers): the
#: output dialect of each scheme, and the pause modes of each engine
PER_COMMAND_CHOICES = {"--dialect", "--pause"}


def _flags() -> dict[str, list[tuple[str, click.Option]]]:
    """flag -> [(command path, option)] over every command and subcommand."""
    out: dict[str, list] = defaultdict(list)

    def walk(cmd, path):
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, [*path, name])
            return
        for p in cmd.params:
            if isinstance(p, click.Option):
                for flag in (*p.opts, *p.secondary_opts):
                    out[flag].append((" ".join(path), p))

    walk(main, [])
    return out


def test_walk_sees_every_command():
    flags = _flags()
    assert {c for c, _ in flags["--force"]} >= {"mxfp8", "nvfp4", "bf16", "unshuffle", "demo", "push"}
    assert {c for c, _ in flags["--pause"]} == {"reload vllm", "reload sglang"}
    assert {c for c, _ in flags["--last-n-bf16"]} == {"mxfp8", "nvfp4", "bf16", "demo"}


def test_each_flag_has_one_meaning():
    for flag, uses in _flags().items():
        visible = [(c, p) for c, p in uses if not p.hidden]
        for c, p in uses:
            if p.hidden:  # a deprecated spelling kept for one release, said so in its help
                assert (p.help or "").startswith("Deprecated spelling of --"), (flag, c)
        if len(visible) < 2:
            continue
        names = {p.name for _, p in visible}
        assert len(names) == 1, (flag, {c: p.name for c, p in visible})
        if flag in PER_COMMAND_CHOICES:
            assert all(isinstance(p.type, click.Choice) for _, p in visible), flag
            continue
        kinds = {(type(p.type).__name__, p.is_flag, p.multiple, p.help) for _, p in visible}
        assert len(kinds) == 1, (flag, {c: (type(p.type).__name__, p.help) for c, p in visible})


@pytest.mark.parametrize("cmd", ["demo", "mxfp8"])
@pytest.mark.parametrize("value", ["-1", "x"])
def test_last_n_bf16_validated(cmd, value, tmp_path):
    """demo refuses a negative or non-integer --last-n-bf16 as convert does: one error line naming
    the option, exit 1 (the top-level guard's), nothing written."""
    dst = tmp_path / "dst"
    args = [cmd, str(dst)] if cmd == "demo" else [cmd, str(tmp_path / "src"), str(dst), "--no-progress"]
    r = CliRunner().invoke(main, [*args, "--last-n-bf16", value])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Invalid value for '--last-n-bf16'" in lines[0]
    assert ("-1 is not in the range x>=0" if value == "-1" else "'x' is not a valid integer") in lines[0]
    assert not dst.exists()
