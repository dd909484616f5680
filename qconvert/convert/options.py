"""What a conversion is asked to do (:class:`ConvertOptions`) and what it reports (:class:`ConvertResult`).

The scheme is stated once: ``ConvertOptions.scheme``. The plan options it carries
(``ConvertOptions.plan``) take their scheme from it, so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import QConvertError
from .plan import Plan, PlanOptions


@dataclass
class ConvertOptions:
    scheme: str = "mxfp8"  # the truth: plan.scheme is set from it (__post_init__, resolve_scheme)
    dialect: str | None = None
    plan: PlanOptions = field(default_factory=PlanOptions)
    device: str = "cpu"
    force: bool = False
    dry_run: bool = False
    allow_non_finite: bool = False
    progress: bool | None = None  # None: on a terminal only
    queue_bytes: int = 512 << 20  # read-ahead bound: input bytes read whose outputs are not written yet
    fsync: bool = True
    recipe: str = "te"  # NVFP4: te | modelopt | 4over6 (numerics.nvfp4.NVFP4_RECIPES)
    input_mode: str = "weight-only"  # NVFP4: weight-only (W4A16) | unit | copied
    input_scales_from: str | None = None  # NVFP4: checkpoint to copy calibrated input scales from
    layout: str | None = None  # "flashinfer-trtllm": MoE experts pre-shuffled (jobs.moe_layer_job)
    engine: str = "vllm"  # layout target engine: vllm | sglang
    tp: int = 1
    ep: int = 1
    allow_pickle: bool = False  # read .bin/.pt with torch.load(weights_only=True), via a safetensors copy
    resume: bool = False  # continue an interrupted run from its journal (resume.py)
    source_checksums: bool = True  # sha256 of each source shard in the manifest (free for Hub-cache files)
    output_checksums: bool = True  # sha256 of each output shard (manifest, verify, resume); --no-checksums

    def __post_init__(self):
        self._sync_plan()

    def _sync_plan(self):
        if self.plan.scheme != self.scheme:
            self.plan = replace(self.plan, scheme=self.scheme)


def resolve_scheme(scheme: str | None, opts: ConvertOptions | None) -> ConvertOptions:
    """The options of one conversion: ``scheme`` (the ``convert()`` argument) and ``opts.scheme``
    must agree when both are given; the plan options follow ``opts.scheme`` (also when it was
    changed after the options were made)."""
    if opts is None:
        return ConvertOptions(scheme=scheme or "mxfp8")
    if scheme is not None and scheme != opts.scheme:
        raise QConvertError(
            f"convert(): scheme {scheme!r} disagrees with ConvertOptions.scheme {opts.scheme!r}; "
            "state the scheme once, in ConvertOptions(scheme=...)"
        )
    opts._sync_plan()
    return opts


@dataclass
class PlanRow:
    module: str
    action: str
    fmt: str
    shape: tuple
    bytes_in: int
    bytes_out: int
    reason: str
    sources: tuple[str, ...] = ()  # the source tensors of this row's job (fused groups, layout layers)


@dataclass
class ConvertResult:
    dst: Path | None
    plan: Plan
    scheme: str
    dialect: str
    rows: list[PlanRow]
    bytes_in: int
    bytes_out: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    options: ConvertOptions | None = None  # what was asked: recipe, activations, layout (the summary says them)

    @property
    def n_quantized(self) -> int:
        return len(self.plan.quantized)

    @property
    def n_kept(self) -> int:
        return len(self.plan.kept)
