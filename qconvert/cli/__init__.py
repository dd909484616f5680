"""The ``qconvert`` command: a thin click layer over the library.

One module per command group (``convert``: mxfp8/nvfp4/bf16/unshuffle/demo; ``inspect``:
inspect/verify; ``hub``: push; ``reload``: reload/stage), every option declared once in
``options``, and the top-level guard in ``guard``. Nothing here imports torch: arguments and
DST are checked first."""

from __future__ import annotations

import click

from .. import __version__
from . import convert, hub, inspect, reload
from .guard import GuardedGroup


@click.group(cls=GuardedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qconvert")
def main():
    """Convert BF16 Hugging Face checkpoints to MXFP8 / NVFP4 for vLLM and SGLang, and hot-reload them."""


for _cmd in (*convert.COMMANDS, *reload.COMMANDS, *inspect.COMMANDS, hub.push):
    main.add_command(_cmd)

__all__ = ["main"]
