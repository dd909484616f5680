"""Every option of the ``qconvert`` commands, declared once, with one meaning; the command modules
stack them with :func:`options`. Imports only click and the pure :mod:`qconvert.formats` (the CLI checks arguments
before torch loads)."""

from __future__ import annotations

import click

from ..formats.dialects import DIALECTS
from ..formats.schemes import NVFP4_RECIPES


def options(*decorators):
    """Apply click decorators in the order written (the first one is listed first in --help)."""

    def apply(fn):
        for d in reversed(decorators):
            fn = d(fn)
        return fn

    return apply


def given(ctx: click.Context, name: str) -> bool:
    """True when the user passed option ``name`` (on the command line or from the environment)."""
    src = ctx.get_parameter_source(name)
    return src is not None and src not in (click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP)


# ------------------------------------------------------------------------------- shared by several groups

#: convert commands, unshuffle, demo: what to do with an existing output directory
FORCE = click.option("--force", is_flag=True, help="Replace DST if it exists (only after the new output is complete).")


def _deprecated_force(ctx: click.Context, param: click.Parameter, value):
    """``push --force``, the spelling before --allow-unverified: still works for one release."""
    if value:
        click.echo(
            "note: `qconvert push --force` is deprecated and goes in the next release; use --allow-unverified", err=True
        )
    return value


#: push: push although verify failed or could not run (``--force`` means "replace DST" everywhere else)
ALLOW_UNVERIFIED = options(
    click.option("--allow-unverified", is_flag=True, help="Push even if verify fails or cannot run."),
    click.option(
        "--force",
        "old_force",
        is_flag=True,
        hidden=True,
        callback=_deprecated_force,
        help="Deprecated spelling of --allow-unverified.",
    ),
)
PROGRESS = click.option("--progress/--no-progress", default=None, help="Progress bar (default: on a terminal).")
JSON = click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
MAX_REL_ERR = click.option(
    "--max-rel-err",
    type=float,
    default=None,
    help="Fail a quantized tensor whose relative error exceeds X (default: 0.06 MXFP8, 0.16 NVFP4).",
)
PRIVATE = click.option(
    "--private", is_flag=True, help="Create the Hub repo private (convert commands: with --push-to-hub)."
)
REVISION = click.option(
    "--revision", default=None, help="Hub branch to push to, created if missing (convert commands: with --push-to-hub)."
)

# ------------------------------------------------------------------------------- convert commands


def last_n_bf16(default: int):
    """``--last-n-bf16``: the convert commands' (default 0) and demo's (default 1, one BF16 layer)."""
    return click.option(
        "--last-n-bf16",
        type=click.IntRange(min=0),
        default=default,
        show_default=True,
        help="Keep the last N decoder layers in BF16.",
    )


SRC = click.argument("src")
DST = click.argument("dst")
DST_OPTIONAL = click.argument("dst", required=False)

PLAN = options(
    SRC,
    DST_OPTIONAL,
    last_n_bf16(0),
    click.option(
        "--first-n-bf16",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Keep the first M decoder layers in BF16.",
    ),
    click.option(
        "--keep-bf16", multiple=True, metavar="PATTERN", help="Keep modules matching this glob in BF16 (repeatable)."
    ),
    click.option("--quantize-lm-head", is_flag=True, help="Quantize lm_head too (engines usually keep it BF16)."),
    click.option("--dry-run", is_flag=True, help="Print the per-layer plan and projected size; write nothing."),
    FORCE,
    click.option(
        "--device",
        type=click.Choice(["cpu", "cuda"]),
        default="cpu",
        show_default=True,
        help="Where to quantize. cpu: one-pass C kernels built at first use with $CC/cc "
        "(QCONVERT_CPU_KERNELS=0: torch code); cuda: Triton kernels "
        "(QCONVERT_CUDA_QUANTIZER=eager|compile: torch code). Same bytes either way.",
    ),
    click.option(
        "--allow-non-finite", is_flag=True, help="Convert weights holding NaN/Inf (recorded in the manifest)."
    ),
    PROGRESS,
    click.option(
        "--allow-pickle",
        is_flag=True,
        help="Read a .bin/.pt checkpoint with torch.load(weights_only=True) "
        "(tensors only; no code runs), via a safetensors copy beside DST.",
    ),
    click.option(
        "--push-to-hub", default=None, metavar="REPO", help="After converting, verify DST and push it to this Hub repo."
    ),
    PRIVATE,
    REVISION,
    click.option(
        "--resume",
        is_flag=True,
        help="Continue an interrupted run of the same command from its last "
        "complete output shard (verified by sha256); the result is byte-identical to an uninterrupted run.",
    ),
    click.option(
        "--no-source-checksums",
        is_flag=True,
        help="Do not sha256 the source shards (the manifest then "
        "records none, and verify cannot tell whether DST came from SRC); saves a core-second per 1.5-2 GB "
        "read, for loops that convert a fresh checkpoint every step. Output shards are still hashed (see "
        "--no-checksums); Hub-cache sources cost nothing either way (the digest is the cached file's name).",
    ),
    click.option(
        "--no-checksums",
        is_flag=True,
        help="Hash nothing: neither source nor output shards (implies "
        "--no-source-checksums). verify then cannot detect a shard changed after conversion, and "
        "--resume keeps finished shards by size. Saves a core-second per 1.5-2 GB of output: for "
        "loops that write a fresh checkpoint every step and load it at once.",
    ),
)

#: kernel-ready MoE expert layouts; --engine is the engine whose post-processing the layout reproduces
LAYOUT = options(
    click.option(
        "--layout",
        type=click.Choice(["flashinfer-trtllm"]),
        default=None,
        help="Write MoE experts pre-shuffled for the FlashInfer TRT-LLM MoE kernels.",
    ),
    click.option(
        "--engine",
        type=click.Choice(["vllm", "sglang"]),
        default="vllm",
        show_default=True,
        help="With --layout: engine whose post-processing the layout reproduces (padding, names, shapes).",
    ),
    click.option(
        "--tp",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="With --layout: tensor-parallel size; write per-rank tensors.",
    ),
    click.option(
        "--ep",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="With --layout: expert-parallel size; write per-rank tensors.",
    ),
)

MXFP8_DIALECT = click.option(
    "--dialect",
    type=click.Choice(list(DIALECTS["mxfp8"])),
    default="auto",
    show_default=True,
    help="auto: loads in vLLM and SGLang; sglang: miles-style weight_scale_inv; modelopt: ModelOpt MXFP8.",
)

NVFP4 = options(
    click.option(
        "--dialect",
        type=click.Choice(list(DIALECTS["nvfp4"])),
        default="modelopt",
        show_default=True,
        help="modelopt: ModelOpt NVFP4; compressed-tensors: nvfp4-pack-quantized.",
    ),
    click.option(
        "--recipe",
        type=click.Choice(list(NVFP4_RECIPES)),
        default="te",
        show_default=True,
        help="te: TransformerEngine / FlashInfer (no fast math) operation order; modelopt: ModelOpt's; "
        "4over6: TransformerEngine 2.17's 4over6 (per block the better of max->6 and max->4; "
        "global scale amax/1536, MAE).",
    ),
    click.option(
        "--weight-only",
        "input_mode",
        flag_value="weight-only",
        help="W4A16: no activation scales; engines run weight-only NVFP4 (the default).",
    ),
    click.option(
        "--input-scale",
        "input_scale",
        type=click.Choice(["unit"]),
        help="unit: W4A4 with input scale 1.0 (for engines in per-token activation mode).",
    ),
    click.option(
        "--input-scales-from",
        type=click.Path(),
        default=None,
        metavar="CKPT",
        help="W4A4 with calibrated input scales copied from an NVFP4 checkpoint of the same model.",
    ),
    click.option(
        "--experts-only", is_flag=True, help="Quantize only MoE experts; attention and dense layers stay BF16."
    ),
)

#: ``qconvert demo``: which tiny model, which scheme; its --last-n-bf16 keeps one BF16 layer by default
DEMO = options(
    click.option(
        "--arch", type=click.Choice(["qwen3-moe", "qwen3", "llama-tied"]), default="qwen3-moe", show_default=True
    ),
    click.option("--scheme", type=click.Choice(["mxfp8", "nvfp4"]), default="mxfp8", show_default=True),
    last_n_bf16(1),
    click.option(
        "--seed",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Seed of the random weights: another seed gives a checkpoint of the same shapes and "
        "options (one to hot-reload into a server started on the first).",
    ),
)

#: options that only mean something with another one; refused without it instead of ignored
NEEDS = {
    "tp": "--layout",
    "ep": "--layout",
    "engine": "--layout",
    "private": "--push-to-hub",
    "revision": "--push-to-hub",
}
#: options of the plan that choose what is quantized: meaningless for `qconvert bf16`
QUANT_ONLY = ("last_n_bf16", "first_n_bf16", "keep_bf16", "quantize_lm_head")

# ------------------------------------------------------------------------------- verify


def _deprecated_engine(ctx: click.Context, param: click.Parameter, value):
    """``verify --engine vllm``, the spelling before --check-in-engine: still works for one release."""
    if value is not None:
        click.echo(
            "note: `qconvert verify --engine` is deprecated and goes in the next release; "
            "use --check-in-engine " + value,
            err=True,
        )
    return value


CHECK_IN_ENGINE = options(
    click.option(
        "--check-in-engine",
        "check_in_engine",
        type=click.Choice(["vllm"]),
        default=None,
        help="Also run SRC and DST in this engine and compare next-token distributions.",
    ),
    click.option(
        "--engine",
        "old_engine",
        type=click.Choice(["vllm"]),
        default=None,
        hidden=True,
        expose_value=True,
        callback=_deprecated_engine,
        help="Deprecated spelling of --check-in-engine.",
    ),
    click.option(
        "--max-kl",
        type=float,
        default=None,
        help="With --check-in-engine: fail when the mean next-token KL exceeds X (default: 0.1 MXFP8, 0.55 NVFP4).",
    ),
)

# ------------------------------------------------------------------------------- reload / stage

#: deadlines when --timeout is not given: control requests / the pause and the weight load
CONTROL_TIMEOUT = 30.0
RELOAD_TIMEOUT = 3600.0

RELOAD = options(
    click.argument("targets", nargs=-1, required=True, metavar="URL [URL ...] CKPT"),
    click.option(
        "--via",
        type=click.Choice(["disk", "shm"]),
        default="disk",
        show_default=True,
        help="disk: servers read CKPT; shm: stage CKPT in /dev/shm/qconvert first, servers read RAM.",
    ),
    click.option("--weight-version", default=None, help="Weight version label set on the servers."),
    click.option(
        "--api-key",
        envvar="QCONVERT_API_KEY",
        default=None,
        help="Sent as 'Authorization: Bearer KEY' (vLLM --api-key, SGLang --api-key/--admin-api-key).",
    ),
    click.option("--verify", is_flag=True, help="Check the servers' weights and a greedy prompt after the reload."),
    click.option("--stage-name", default=None, help="Staging area name for --via shm (default: from CKPT)."),
    click.option(
        "--keep-staged", is_flag=True, help="With --via shm: keep the staging area after the reload (default: removed)."
    ),
    click.option(
        "--retries",
        type=click.IntRange(0, 100),
        default=3,
        show_default=True,
        help="Retries (exponential backoff) on connection errors and 502/503/504, within --timeout.",
    ),
    click.option(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"Deadline of every request to a server, retries included [default: "
        f"{CONTROL_TIMEOUT:g} s; {RELOAD_TIMEOUT:g} s for the pause and the weight load].",
    ),
    click.option(
        "--reload-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="Deadline of the pause (which waits for running requests) and of the weight load "
        "alone [default: --timeout if given, else 3600 s].",
    ),
)
