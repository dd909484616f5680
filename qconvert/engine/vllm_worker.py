"""qconvert's vLLM worker extension: imported INSIDE a vLLM server's worker processes, started with
``--worker-extension-cls qconvert.engine.vllm_worker.WorkerExtension``. The reload client
(:mod:`qconvert.client.vllm_client`) calls its methods through ``/collective_rpc``.

Why it exists (vLLM 0.32.0, found in testing; see :mod:`qconvert.client.vllm_client`): the CPU
build leaves MoE experts unprepacked after ``reload_weights`` (``qconvert_repack_cpu_moe``), a
failed reload leaves half-loaded layers' buffers behind (``qconvert_clear_failed_reload``), a
pre-shuffled checkpoint needs its own loader (``qconvert_load_preshuffled``), and a staging area
loads without a copy or a header parse, each rank reading its own files (``qconvert_load_staged``,
:mod:`qconvert.engine.vllm_staged`).
"""

from __future__ import annotations


def repack_cpu_moe_after_reload(model) -> int:
    """Prepack the experts of every CPU unquantized MoE layer in place (vLLM 0.32 CPU); returns the
    number of layers. Only valid right after a reload that wrote every layer (what qconvert sends)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    n = 0
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if not isinstance(qm, UnquantizedFusedMoEMethod) or getattr(qm, "moe_kernel", None) is None:
            continue
        fe = qm.moe_kernel.fused_experts
        if not isinstance(fe, CPUUnquantizedExperts) or getattr(fe, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            prepack_experts_in_place(getattr(m, name).data, fe.isa)
        n += 1
    return n


def prepack_experts_in_place(w, isa: str) -> None:
    """vLLM's CPU MoE prepack (``_custom_ops.cpu_prepack_moe_weight``) of the experts ``w``
    [E, N, K], written back into ``w``'s storage (the served one). One expert at a time through a
    scratch of one expert: the op packs each expert on its own (the same bytes as packing the whole
    tensor at once, tests/test_reload_staged.py), and the whole-tensor form's fresh output of the
    layer's size paid a first-touch page fault per page at every reload (about 2x slower)."""
    import torch
    from vllm import _custom_ops  # noqa: F401  (registers torch.ops._C)

    scratch = torch.empty((1, *w.shape[1:]), dtype=w.dtype, device=w.device)
    for e in range(w.shape[0]):
        # the op only reads its input and writes ``scratch``; then one copy back
        torch.ops._C.prepack_moe_weight(w[e : e + 1], scratch, isa)
        w[e : e + 1].copy_(scratch)


def weights_digest(model) -> dict[str, str]:
    """xxh3_128 of the bytes of every parameter and buffer the model serves, by name: two loads
    that leave equal digests left the served tensors equal (replicas, or a load path against
    vLLM's own reload of the same area)."""
    import itertools

    import torch

    from qconvert.convert.safetensors_io import xxh3_128_hex

    out = {}
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            if t.is_meta:
                continue
            host = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
            out[name] = f"{t.dtype}:{tuple(t.shape)}:{xxh3_128_hex(host.numpy())}"
    return out


class WorkerExtension:
    """vLLM worker extension (``--worker-extension-cls``); method names are prefixed ``qconvert_``
    because vLLM refuses extension attributes that already exist on the worker."""

    def qconvert_ping(self) -> str:
        from qconvert import __version__

        return f"qconvert-{__version__}"

    def qconvert_clear_failed_reload(self) -> int:
        """Drop the tensors a failed ``reload_weights`` buffered for layers it did not finish, so the
        rollback reload starts those layers from zero (vLLM 0.32 keeps them and would mix them in)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        n = 0
        for m in self.model_runner.get_model().modules():
            info = LAYERWISE_INFO.get(m)
            if info is not None and info.can_load() and (info.loaded_weights or info.load_numel):
                info.loaded_weights = []
                info.load_numel = 0
                n += 1
        return n

    def qconvert_repack_cpu_moe(self) -> int:
        import torch

        with torch.no_grad():
            return repack_cpu_moe_after_reload(self.model_runner.get_model())

    def qconvert_load_preshuffled(self, path: str) -> dict:
        """Load a pre-shuffled (flashinfer-trtllm layout) checkpoint: see vllm_layout_loader."""
        from qconvert.engine.vllm_layout_loader import load_into_worker

        return load_into_worker(self, path)

    def qconvert_load_staged(
        self,
        area: str,
        verify: bool = False,
        profile: int = 0,
        direct: bool | list | None = None,
        device_chunks: bool | None = None,
        keep_maps: bool | None = None,
        marlin_gather: bool | None = None,
        loader_copies: bool | None = None,
    ) -> dict:
        """Load the committed content of the staging area at ``area`` (v1 or v2) from mappings of
        this rank's files: see vllm_staged; in place where exact (vllm_direct; ``direct=False``
        forces vLLM's layerwise reload, a list of form names takes only those forms directly);
        ``device_chunks=False`` hands a GPU server host views; ``keep_maps`` (default: the server's
        QCONVERT_STAGED_KEEP_MAPS, on a GPU server unless ``0``) takes a refit area from the kept, registered
        mappings instead of mapping it afresh; ``marlin_gather`` (default: the server's
        QCONVERT_GPU_MARLIN_GATHER, on a GPU server unless ``0``) runs vLLM's MXFP8 MoE Marlin
        preparation as one byte gather per tensor (vllm_marlin); ``loader_copies`` (default: the
        server's QCONVERT_LOADER_COPIES, on unless ``0``) makes the replayed modules' loader calls
        as their recorded copies (vllm_replay).
        Returns load statistics (files, bytes, seconds, ``path``; with ``profile`` > 0 the most
        expensive functions of the load)."""
        from qconvert.engine.vllm_staged import load_staged_into_worker

        return load_staged_into_worker(
            self,
            area,
            verify=verify,
            profile=profile,
            direct=direct,
            device_chunks=device_chunks,
            keep_maps=keep_maps,
            marlin_gather=marlin_gather,
            loader_copies=loader_copies,
        )

    def qconvert_release_staged(self, area: str | None = None) -> int:
        """Let go of the mappings this worker keeps of the refit area at ``area`` (every area when
        None): vllm_staged.KeptMaps. Returns how many files it let go of."""
        from qconvert.engine.vllm_staged import KEPT

        return KEPT.release(area)

    def qconvert_weights_digest(self) -> dict[str, str]:
        """Digest of every served tensor (:func:`weights_digest`)."""
        return weights_digest(self.model_runner.get_model())

    def qconvert_copy_floor(self, area: str, repeat: int = 3, keep_maps: bool | None = None) -> dict:
        """Benchmark floor (scripts/bench_reload.py): a plain copy of the bytes this rank would load
        from ``area`` into preallocated tensors, timed in this worker (vllm_staged.copy_floor)."""
        from qconvert.engine.vllm_staged import copy_floor

        return copy_floor(self.model_runner.get_model(), area, repeat=repeat, keep_maps=keep_maps)
