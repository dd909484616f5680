"""Invert a pre-shuffled (``--layout flashinfer-trtllm``) checkpoint back to the plain one.

Shard by shard: every tensor of one MoE layer's layout job sits in one shard (see
:mod:`layout_jobs`), so a shard is read whole, its layout tensors are turned back into
per-expert HF tensors with :func:`layouts.trtllm.untransform_moe_layer`, and the rest is copied.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..errors import CheckpointError, OutputError
from ..formats.dialects import NVFP4_SCALAR_SUFFIXES, mxfp8_scale_suffix
from ..formats.manifest import LAYOUT_KEY, MANIFEST_NAME, layout_section
from ..interrupts import ctrl_c_safe
from .checkpoint import INDEX_NAME
from .layout_jobs import parse_rank_tag
from .layouts import trtllm
from .safetensors_io import ShardReader, ShardWriter, sha256_file


@ctrl_c_safe
def unshuffle_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, force: bool = False) -> dict:
    from .checkpoint import guard, open_checkpoint
    from .destination import check_dst as _check_dst
    from .destination import install as _install

    src, dst = Path(src), Path(dst).expanduser().absolute()
    _check_dst(dst, force, str(src))  # as convert: never DST = SRC, inside it or around it
    ck = open_checkpoint(src, strict=False)  # guarded: config, index, shard headers
    manifest = ck.manifest
    if manifest is None:
        raise CheckpointError(
            f"{src / MANIFEST_NAME}: missing; unshuffle needs a checkpoint written by qconvert --layout"
        )
    layout = layout_section(manifest)
    if not layout:
        raise CheckpointError(f"{src}: not a pre-shuffled checkpoint (its {MANIFEST_NAME} has no layout section)")
    engine, tp, ep = layout["engine"], layout["tp"], layout["ep"]
    dialect = manifest.get("dialect")
    scale_suffix = mxfp8_scale_suffix(dialect)
    layer_scheme: dict[str, str] = layout["layers"]
    contracts = layout["contracts"]
    for sch in set(layer_scheme.values()):
        if sch == "nvfp4" and dialect == "compressed-tensors":
            raise CheckpointError(
                f"{src}: compressed-tensors NVFP4 stores 2688/amax, which the layout's decode-convention "
                "scalars cannot give back bit-exactly; re-convert from BF16 (or use --dialect modelopt)"
            )
        if sch == "nvfp4" and engine == "vllm":
            raise CheckpointError(
                f"{src}: NVFP4 experts laid out for vLLM fold the activation scales into the global "
                "scales (docs/layouts.md#nvfp4-scalars-in-vllm), so the plain scales cannot be recovered; re-convert from BF16"
            )

    tmp = dst.parent / f".{dst.name}.qconvert-tmp-{os.getpid()}"
    if os.path.islink(tmp):
        raise OutputError(f"{tmp}: is a symbolic link where unshuffle writes its output; move it away")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    n_layers = n_tensors = 0
    weight_map: dict[str, str] = {}
    total = 0
    try:
        for h in ck.shards:
            f = h.path
            tensors: dict[str, torch.Tensor] = {}
            with ShardReader(h, hash_file=False) as r:
                for e, t in r.iter_tensors():
                    tensors[e.name] = t
            ranks: dict[str, dict[tuple[int, int], dict[str, torch.Tensor]]] = {}
            # (name, tensor), or (experts prefix, None) at the place of a layer's first layout tensor
            plain_out: list[tuple[str, torch.Tensor | None]] = []
            for name, t in tensors.items():
                parts = name.split(".")
                rq = None
                for i, p in enumerate(parts):
                    rq = parse_rank_tag(p)
                    if rq is not None:
                        prefix, param = ".".join(parts[:i]), ".".join(parts[i + 1 :])
                        break
                if rq is None:
                    plain_out.append((name, t))
                    continue
                if prefix not in ranks:
                    plain_out.append((prefix, None))
                ranks.setdefault(prefix, {}).setdefault(rq, {})[param] = t
            final: list[tuple[str, torch.Tensor]] = []
            for name, t in plain_out:
                if t is not None:
                    final.append((name, t))
                    continue
                prefix = name
                scheme = layer_scheme.get(prefix)
                if scheme is None:
                    raise CheckpointError(f"{f}: layout tensors of {prefix} are not listed in the manifest")
                c = contracts[scheme]
                got = ranks[prefix]
                if len(got) != tp * ep:
                    raise CheckpointError(f"{f}: {prefix} has {len(got)} of {tp * ep} ranks; the shard is incomplete")
                plain = trtllm.untransform_moe_layer(
                    got,
                    scheme,
                    engine,
                    intermediate_size=c["intermediate_size"],
                    hidden_size=c["hidden_size"],
                    tp=tp,
                    ep=ep,
                )
                per_expert = trtllm.unstack_hf_experts(plain, prefix, scale_suffix=scale_suffix)
                if scheme == "nvfp4" and dialect == "modelopt":
                    per_expert = {
                        k: (v.reshape(()) if k.endswith(NVFP4_SCALAR_SUFFIXES) else v) for k, v in per_expert.items()
                    }

                # natural order: expert, then gate/up/down, then suffix
                def key(k, prefix=prefix):
                    rest = k[len(prefix) + 1 :].split(".")
                    return (int(rest[0]), ["gate_proj", "up_proj", "down_proj"].index(rest[1]), rest[2])

                for k in sorted(per_expert, key=key):
                    final.append((k, per_expert[k].contiguous()))
                n_layers += 1
            w = ShardWriter(tmp / f.name, [(n, t.dtype, tuple(t.shape)) for n, t in final])
            for n, t in final:
                w.write(n, t)
                weight_map[n] = f.name
                total += t.numel() * t.element_size()
                n_tensors += 1
            w.close()
        for p in sorted(src.iterdir()):
            if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (INDEX_NAME, MANIFEST_NAME):
                shutil.copy2(guard(src, p), tmp / p.name)
        if (src / INDEX_NAME).exists():
            (tmp / INDEX_NAME).write_text(
                json.dumps(
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2
                )
                + "\n"
            )
        manifest = dict(manifest)
        manifest.pop(LAYOUT_KEY)
        manifest["unshuffled_from"] = str(src)
        manifest["outputs"] = {"sha256": {f.name: sha256_file(f) for f in sorted(tmp.glob("*.safetensors"))}}
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        _install(tmp, dst, force)  # the old DST moved aside, restored if the rename fails
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"layers": n_layers, "tensors": n_tensors}
