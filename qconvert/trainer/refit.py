"""Trainer-side refit: quantize live BF16 weights exactly like the converter, stage them in shared
memory layer by layer, and reload them into running servers.

    from qconvert.trainer.refit import refit
    refit(model.named_parameters(), reference="/ckpt/Qwen3-30B-A3B",          # the BF16 source
          urls=["http://gen-0:8000", "http://gen-1:8000"], engine="vllm",
          options=ConvertOptions(scheme="mxfp8", plan=PlanOptions(last_n_bf16=8)),
          stage_name="policy", weight_version=f"step-{step}")

* **Same plan, names and scales as the converter.** The plan is built by the converter's own
  ``build_plan`` from the reference checkpoint's tensor inventory (names, dtypes, shapes; only
  headers are read) and ``config.json``, and every output tensor is produced by the converter's own
  job functions (``jobs.build_jobs``: same exclusions, same fused-group global scales for
  NVFP4, same dialect names); ``config.json`` gets the converter's ``quantization_config``. So the
  staged bytes equal ``qconvert`` converting the same weights from disk (tested).
* **Layer by layer.** Tensors are buffered per decoder layer; when every tensor of a layer has
  arrived its jobs run and the whole layer is written as one staging group (vLLM's layerwise
  reload processes a layer only when all of its tensors are loaded). Peak memory: the layers in
  flight (one, when the trainer yields in layer order).
* **CPU or CUDA**: tensors are quantized on the device they arrive on when ``options.device`` is
  ``"cuda"``; outputs are copied to host memory for staging.
* Not supported here: pre-shuffled layouts (``options.layout``), and NVFP4 ``input_mode="copied"``
  needs ``input_scales_from`` like the converter.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from qconvert.errors import QConvertError
from qconvert.formats.manifest import MANIFEST_NAME
from qconvert.client import staging


@dataclass
class RefitResult:
    area: staging.StagingArea
    reload: list = field(default_factory=list)
    tensors_in: int = 0
    tensors_out: int = 0


def reference_inventory(reference: str | os.PathLike) -> tuple[dict, dict[str, tuple[str, tuple]]]:
    """(config, {name: (dtype tag, shape)}) of a BF16 source checkpoint, from headers only."""
    from qconvert.convert.safetensors_io import read_header

    root = Path(reference)
    config = staging.read_config(root)  # guarded, as every checkpoint read
    inv = {}
    for shard in staging.shard_files(root):
        for e in read_header(shard).entries.values():
            inv[e.name] = (e.dtype, tuple(e.shape))
    return config, inv


def _quant_config(scheme: str, plan, dialect: str, opts) -> tuple[dict | None, dict]:
    from qconvert.formats import dialects

    return dialects.quant_config(scheme, dialect, plan.exclusions, opts.input_mode)


def stage_refit(named_tensors: Iterable[tuple[str, torch.Tensor]], *, reference: str | os.PathLike,
                stage_name: str, options=None, root: Path | None = None) -> RefitResult:
    """Quantize ``named_tensors`` with the converter's plan for ``reference`` and stage them as ``stage_name``."""
    from qconvert.formats import dialects
    from qconvert.convert.pipeline import ConvertOptions, build_jobs
    from qconvert.convert import fused
    from qconvert.convert.plan import build_plan

    opts = options or ConvertOptions()
    if opts.layout:
        raise QConvertError("refit does not pre-shuffle (options.layout); reload plain checkpoints")
    scheme = opts.scheme
    config, inv = reference_inventory(reference)
    inv, views = fused.expand(inv, config)  # a fused reference is planned per expert (docs/formats.md#fused-expert-tensors)
    plan = build_plan(inv, config, opts.plan)
    dialect = dialects.resolve_dialect(scheme, opts.dialect)
    jobs = build_jobs(plan, scheme, dialect, opts).jobs  # the plan holds each tensor's dtype and shape

    # which jobs each layer group needs, and which source tensors complete it
    group_jobs: dict[tuple, list] = {}
    for j in jobs:
        keys = {staging.group_key(o.name) for o in j.outputs}
        if len(keys) != 1:
            raise QConvertError(f"a converter job spans several layers ({sorted(keys)}); cannot stage it per layer")
        group_jobs.setdefault(keys.pop(), []).append(j)
    need: dict[tuple, set[str]] = {k: {s for j in js for s in j.sources} for k, js in group_jobs.items()}
    group_of_source = {s: k for k, srcs in need.items() for s in srcs}

    qcfg, extra = _quant_config(scheme, plan, dialect, opts)
    out_config = dict(config)
    if qcfg is not None:
        out_config["quantization_config"] = qcfg

    res_in = res_out = 0
    buffers: dict[tuple, dict[str, torch.Tensor]] = {}
    with staging.StagingWriter(stage_name, root=root, source=f"refit of {Path(reference).resolve()}",
                               config=out_config) as w:
        def flush(key):
            nonlocal res_out
            src = buffers.pop(key)
            batch = []
            for j in group_jobs[key]:
                outs = j.fn({s: src[s] for s in j.sources})
                for o in j.outputs:
                    t = outs[o.name]
                    if tuple(t.shape) != tuple(o.shape) or t.dtype != o.dtype:
                        raise QConvertError(f"refit: {o.name} came out {t.dtype} {tuple(t.shape)}, "
                                            f"expected {o.dtype} {tuple(o.shape)}")
                    batch.append((o.name, staging.dtype_tag(t.dtype), tuple(t.shape), t))
            w.add_group(batch)
            res_out += len(batch)

        # transformers 5 models yield fused experts (…experts.gate_up_proj [E, 2I, H]): split per expert
        for name, t in fused.split_stream(named_tensors, config, views):
            key = group_of_source.get(name)
            if key is None:
                raise QConvertError(f"refit: tensor {name!r} is not in the reference checkpoint {reference}; "
                                    "the trainer's names must be the Hugging Face names")
            want_dtype, want_shape = inv[name]
            if tuple(t.shape) != want_shape or staging.dtype_tag(t.dtype) != want_dtype:
                raise QConvertError(f"refit: {name} is {t.dtype} {tuple(t.shape)}, the reference has "
                                    f"{want_dtype} {list(want_shape)}")
            buf = buffers.setdefault(key, {})
            if name in buf or key not in need:
                raise QConvertError(f"refit: tensor {name!r} given twice")
            buf[name] = t.detach()
            res_in += 1
            if buf.keys() == need[key]:
                flush(key)
                del need[key]
        if need:
            missing = sorted(s for k in need for s in need[k] - buffers.get(k, {}).keys())
            raise QConvertError(f"refit: {len(missing)} tensors never arrived (e.g. {missing[:3]}); "
                                "send every tensor of the model")
        for fname, obj in extra.items():
            w.add_file(fname, json.dumps(obj, indent=2).encode())
        w.add_file("config.json", json.dumps(out_config, indent=2).encode())
        ref = Path(reference)
        for p in sorted(ref.iterdir()):
            if (p.is_file() and p.suffix in (".json", ".txt", ".model", ".jinja", ".tiktoken")
                    and p.name not in ("config.json", staging.INDEX, staging.MANIFEST, MANIFEST_NAME)
                    and p.name not in extra):
                w.add_file(p.name, p.read_bytes())
        area = w.commit()
    return RefitResult(area=area, tensors_in=res_in, tensors_out=res_out)


def refit(named_tensors: Iterable[tuple[str, torch.Tensor]], *, reference: str | os.PathLike, urls: list[str],
          engine: str = "vllm", stage_name: str = "refit", options=None, weight_version: str | None = None,
          api_key: str | None = None, pause: str | None = None, verify: bool = False,
          root: Path | None = None) -> RefitResult:
    """Quantize and stage (see :func:`stage_refit`), then reload the staging area into ``urls``."""
    res = stage_refit(named_tensors, reference=reference, stage_name=stage_name, options=options, root=root)
    kw = dict(weight_version=weight_version, api_key=api_key, verify=verify)
    if engine == "vllm":
        from qconvert.client.vllm_client import reload_vllm

        res.reload = reload_vllm(urls, res.area.path, pause=pause or "wait", **kw)
    elif engine == "sglang":
        from qconvert.client.sglang_client import reload_sglang

        res.reload = reload_sglang(urls, res.area.path, pause=pause or "retract", **kw)
    else:
        raise QConvertError(f"engine {engine!r}: use vllm or sglang")
    return res
