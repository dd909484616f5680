"""Trainer-side refit: quantize live BF16 weights exactly like the converter, write them into a
persistent shared-memory staging area, commit, and reload them into running servers.

    from qconvert.refit import Refitter
    from qconvert.convert.pipeline import ConvertOptions

    refitter = Refitter("/ckpt/Qwen3-30B-A3B",                       # the BF16 reference (config, names)
                        ConvertOptions(scheme="mxfp8", device="cuda"),
                        name="policy", urls=["http://gen-0:8000"], engine="vllm")
    for step in range(steps):
        train_step()
        refitter.refit(model.named_parameters())                     # stage + commit + reload
    refitter.close()

* **Same plan, names and scales as the converter.** The plan is built by the converter's own
  ``build_plan`` from the reference checkpoint's tensor inventory (headers only) and
  ``config.json``, and every output is produced by the converter's own jobs (``jobs.build_jobs``,
  including ``moe_layer_job`` for ``layout="flashinfer-trtllm"``), so the staged bytes equal
  ``qconvert`` converting the same weights from disk (tested tensor by tensor).
* **A persistent two-slot area** (docs/reload.md#staging-area-format): its files are laid out from
  the output inventory (known before any byte), created by the first refit, mapped once (and on
  CUDA registered with ``cudaHostRegister``) and overwritten in place: a refit writes the slot that
  is not committed and ``commit()`` flips ``commit.json``. A later refit whose outputs do not match
  ``area.json`` is refused with one line naming the tensor.
* **Layer by layer.** Tensors are buffered per layer group; when a group is complete its jobs run
  (on CUDA a layer's experts quantized as one stack per tensor kind, MXFP8 and NVFP4 alike, and
  one NaN/Inf check for the group, read once the group's copies are done: no host sync) and its outputs are copied straight into the mapping: on CUDA, device-to-host on a copy stream
  overlapped with the next group's quantization, at most two groups of output alive; on CPU,
  written into the mapping directly. No per-tensor ``.cpu()``, no sha256: each file's xxh3_128 pieces
  digest is computed by a thread pool as soon as its group is written (a large file's pieces on
  several threads).
* **Sharded trainers** (docs/reload.md#sharded-trainers): every trainer rank constructs a
  ``Refitter`` with its ``rank``/``world_size`` and calls ``stage()`` with the whole HF tensors of
  the layers it owns, then ``commit()``; rank 0's ``commit()`` waits for every rank's report (a
  file in the slot) and makes the version visible. A rank that never reports, a tensor staged by
  two ranks or by none: one line, nothing committed, the previous version untouched.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from qconvert.client import staging
from qconvert.errors import QConvertError
from qconvert.formats import staging as fs
from qconvert.interrupts import ctrl_c_safe

_RANK_TAG = re.compile(r"\.(trtllm(?:_tp\d+_ep\d+)?)\.")


class RefitError(QConvertError):
    """A refit was refused: bad tensors, an area of another model, a rank that never reported."""


@dataclass
class Staged:
    """A committed version of a staging area."""

    root: Path  # the area (area.json, config.json, ...)
    path: Path  # the committed slot directory (the safetensors files)
    version: int
    slot: int
    nbytes: int

    @property
    def name(self) -> str:
        return self.root.name


@dataclass
class RefitResult:
    area: Staged | None  # None on a trainer rank other than 0 (rank 0 commits)
    reload: list = field(default_factory=list)
    tensors_in: int = 0
    tensors_out: int = 0
    seconds: dict = field(default_factory=dict)  # stage, commit, reload


def reference_inventory(reference: str | os.PathLike) -> tuple[dict, dict[str, tuple[str, tuple]]]:
    """(config, {name: (dtype tag, shape)}) of a BF16 source checkpoint, from headers only."""
    from qconvert.convert.checkpoint import open_checkpoint

    ck = open_checkpoint(reference, strict=False)  # guarded, as every checkpoint read
    return ck.config, {e.name: (e.dtype, tuple(e.shape)) for h in ck.shards for e in h.entries.values()}


def _reference_files(reference: Path, skip: set[str]) -> dict[str, bytes]:
    from qconvert.convert.checkpoint import read_member

    out = {}
    for p in sorted(reference.iterdir()):
        if (
            p.suffix in (".json", ".txt", ".model", ".jinja", ".tiktoken")
            and not p.name.startswith(".")
            and p.name not in skip
            and fs.EXTRA_FILE_RE.match(p.name)
        ):
            out[p.name] = read_member(reference, p)  # guarded, as every checkpoint read
    return out


class _Copier:
    """Puts each group's outputs into the slot mapping. CUDA: device-to-host on a copy stream after
    the group's quantization, the previous group's copies awaited before the next group's are issued
    (two groups of output alive at most); then the group's files go to the digest pool."""

    def __init__(self, cuda: bool, on_done):
        self.cuda = cuda
        self.on_done = on_done  # called with the group's file names once its bytes are in place
        self.stream = torch.cuda.Stream() if cuda else None
        self.pending: list[tuple] = []

    def put(self, dsts: list[tuple[torch.Tensor, torch.Tensor]], files: list[str], check=None) -> None:
        """``check``: called once the group's copies are done, before its files are handed on (the
        group's deferred NaN/Inf check: it raises to refuse the version)."""
        host = [(d, s) for d, s in dsts if s.device.type == "cpu"]
        dev = [(d, s) for d, s in dsts if s.device.type != "cpu"]
        for d, s in host:
            d.copy_(s)
        if not dev:
            self._retire_all()
            if check is not None:
                check()
            self.on_done(files)
            return
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for d, s in dev:
                d.copy_(s, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.pending.append((done, dev, files, check))
        while len(self.pending) > 1:
            self._retire()

    def _retire(self) -> None:
        done, dev, files, check = self.pending.pop(0)
        done.synchronize()
        del dev
        if check is not None:
            check()
        self.on_done(files)

    def _retire_all(self) -> None:
        while self.pending:
            self._retire()

    def finish(self) -> None:
        self._retire_all()

    def drop(self) -> None:
        """After an error: wait for copies in flight (they write into memory we own), forget them."""
        for done, *_ in self.pending:
            done.synchronize()
        self.pending.clear()


class Refitter:
    """A persistent staging area fed from live weights (see the module docstring).

    ``reference``: the BF16 checkpoint directory the weights come from (config.json, tensor names,
    dtypes and shapes; headers only). ``options``: the :class:`ConvertOptions` of the served
    checkpoint (scheme, dialect, plan, ``device``, and for a pre-shuffled server ``layout``,
    ``engine``, ``tp``, ``ep``). ``name``: the staging area (under ``$QCONVERT_SHM_ROOT`` or
    ``/dev/shm/qconvert``, or ``root``). ``urls``/``engine``: the servers :meth:`reload` reloads.
    ``rank``/``world_size``: this trainer rank, for a sharded trainer.
    """

    _BATCHED: bool | None = None  # batched checks and copies: None = on CUDA (tests set True on CPU)

    def __init__(
        self,
        reference: str | os.PathLike,
        options=None,
        name: str = "refit",
        urls: Iterable[str] = (),
        engine: str = "vllm",
        *,
        rank: int = 0,
        world_size: int = 1,
        root: str | os.PathLike | None = None,
        lock_wait_s: float = 60.0,
        rendezvous_timeout_s: float = 600.0,
        api_key: str | None = None,
        pause: str | None = None,
        verify: bool = False,
        hash_threads: int | None = None,
    ):
        from qconvert import __version__
        from qconvert.convert import jobs as jobs_mod
        from qconvert.convert.jobs import build_jobs
        from qconvert.convert.metadata import module_formats, output_config, scheme_keys
        from qconvert.convert.options import ConvertOptions
        from qconvert.convert.plan import build_plan
        from qconvert.formats import dialects
        from qconvert.formats.manifest import LAYOUT_KEY, MANIFEST_NAME, VERSION_KEY

        opts = options or ConvertOptions()
        fs.check_name(name)
        if engine not in ("vllm", "sglang"):
            raise RefitError(f"engine {engine!r}: use vllm or sglang")
        if engine == "sglang" and list(urls):
            from qconvert.client.sglang_client import refusal, unreadable

            why = unreadable(layout=bool(opts.layout), per_rank=bool(opts.layout) and (opts.tp, opts.ep) != (1, 1))
            if why is not None:
                raise RefitError(refusal(f"refit area {name!r} for SGLang servers", why))
        if opts.layout and opts.engine != engine:
            raise RefitError(
                f"options.engine {opts.engine!r} (the layout's engine) differs from the servers' "
                f"engine {engine!r}; pre-shuffle for the engine that serves"
            )
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise RefitError(f"rank {rank!r} / world_size {world_size!r}: need 0 <= rank < world_size")
        if opts.device != "cpu" and not torch.cuda.is_available():
            raise RefitError(f"options.device {opts.device!r}: CUDA is not available here; use device='cpu'")
        self.reference = Path(reference)
        self.options, self.name, self.urls, self.engine = opts, name, list(urls), engine
        self.rank, self.world_size = rank, world_size
        self.root = Path(root) if root is not None else fs.staging_root()
        self.area = self.root / name
        self.lock_wait_s, self.rendezvous_timeout_s = lock_wait_s, rendezvous_timeout_s
        self.api_key, self.pause, self.verify = api_key, pause, verify
        self._dev = torch.device(opts.device)
        self._cuda = self._dev.type == "cuda"

        from qconvert.convert import fused

        config, inv = reference_inventory(self.reference)
        inv, self._views = fused.expand(
            inv, config
        )  # a fused reference is planned per expert (docs/formats.md#fused-expert-tensors)
        self._config, self._inv = config, inv
        popts = opts.plan
        if self._views and popts.keep_bf16:  # as the converter: a fused name keeps its layer's experts
            import dataclasses

            popts = dataclasses.replace(popts, keep_bf16=fused.keep_patterns(popts.keep_bf16, self._views))
        plan = build_plan(inv, config, popts)
        scheme = opts.scheme
        dialect = dialects.resolve_dialect(scheme, opts.dialect)
        # On CUDA the jobs' own NaN/Inf checks cost a host sync per tensor (hundreds per MoE layer):
        # the jobs run unchecked and one batched check per layer group, read when the group's
        # copies are done (no sync of its own), refuses the same inputs.
        self._batched = self._dev.type == "cuda" if self._BATCHED is None else self._BATCHED
        self._check_group = self._batched and not opts.allow_non_finite
        built = build_jobs(plan, scheme, dialect, replace(opts, allow_non_finite=True) if self._check_group else opts)

        jobs_list = built.jobs
        if opts.device in jobs_mod.STACKED_DEVICES:  # a layer's same-shape tensors in one launch
            check = not (opts.allow_non_finite or self._check_group)
            jobs_list = _stack_mxfp8(jobs_list, inv, opts.device, check)
            jobs_list = _stack_nvfp4(jobs_list, inv, dialect, opts, check)
        # layer groups: which jobs each needs, and which source tensors complete it
        group_jobs: dict[tuple, list] = {}
        for j in jobs_list:
            keys = {staging.group_key(o.name) for o in j.outputs}
            if len(keys) != 1:
                raise RefitError(f"a converter job spans several layers ({sorted(keys)}); cannot stage it per layer")
            group_jobs.setdefault(keys.pop(), []).append(j)
        self._keys = sorted(group_jobs)
        self._gidx = {k: i for i, k in enumerate(self._keys)}
        self._group_jobs = group_jobs
        self._need = {k: frozenset(s for j in js for s in j.sources) for k, js in group_jobs.items()}
        self._group_of_source = {s: k for k, srcs in self._need.items() for s in srcs}

        # the area's files, from the output inventory
        tp, ep = (opts.tp, opts.ep) if opts.layout else (1, 1)
        by_file: dict[tuple, list] = {}
        outputs = []
        for k in self._keys:
            for j in group_jobs[k]:
                for o in j.outputs:
                    m = _RANK_TAG.search(o.name) if opts.layout else None
                    rank_of = None
                    if m is not None and (tp, ep) != (1, 1):
                        from qconvert.convert.layout_jobs import parse_rank_tag

                        rank_of = parse_rank_tag(m.group(1))
                    tag = staging.dtype_tag(o.dtype)
                    by_file.setdefault((self._gidx[k], rank_of), []).append((o.name, tag, tuple(o.shape)))
                    outputs.append((o.name, tag, tuple(o.shape)))
        files, headers = [], {}
        for g, r in sorted(by_file, key=lambda x: (x[0], x[1] is not None, x[1] or (0, 0))):
            for f, head in staging.pack_v2(g, r, by_file[(g, r)]):
                files.append(f)
                headers[f.name] = head
        self._files_of_group: dict[int, list[fs.FileSpec]] = {}
        for f in files:
            self._files_of_group.setdefault(int(fs.FILE_RE.match(f.name).group("group")), []).append(f)
        self._file_of_tensor = {n: f for f in files for n in f.tensors}
        # what a refit does per group and does not depend on the values, decided once
        self._in_spec = {
            n: (k, torch.Size(inv[n][1]), staging.DTYPES.get(inv[n][0], (None,))[0])
            for k, srcs in self._need.items()
            for n in srcs
        }
        self._plain = frozenset(n for n in self._in_spec if not fused.FUSED_RE.match(n))
        self._plans = {
            k: _GroupPlan(
                group_jobs[k],
                self._files_of_group[self._gidx[k]],
                self._batched,
                sorted(n for n in self._need[k] if _has_floats(self._in_spec[n])),
            )
            for k in self._keys
        }

        out_config, extra = output_config(config, plan, scheme, dialect, opts)
        layout = None
        extra_files = {fname: (json.dumps(obj, indent=2) + "\n").encode() for fname, obj in extra.items()}
        extra_files["config.json"] = (json.dumps(out_config, indent=2) + "\n").encode()
        manifest = {
            VERSION_KEY: __version__,
            "scheme": scheme,
            "dialect": dialect,
            "engines": dialects.engines_for(scheme, dialect),
            "source": {"id": str(self.reference.resolve()), "architecture": plan.arch_name, "refit": True},
            "exclusions": plan.exclusions,
            **scheme_keys(scheme, dialect, opts),
        }
        if opts.layout:
            from qconvert.convert.layout_jobs import layout_manifest

            layout = manifest[LAYOUT_KEY] = layout_manifest(plan, built.layout_layers, opts.engine, opts.tp, opts.ep)
        manifest["tensors"] = module_formats(plan, scheme)
        extra_files[MANIFEST_NAME] = (json.dumps(manifest, indent=2) + "\n").encode()
        for fname, data in _reference_files(self.reference, set(extra_files) | {staging.INDEX}).items():
            extra_files.setdefault(fname, data)
        contract = staging.layout_contract(out_config, outputs, layout)
        self.spec = fs.AreaSpec(contract, fs.DIGEST_XXH3_PIECES, tp, ep, tuple(files), tuple(sorted(extra_files)))
        self._open_area(headers, extra_files)

        self._maps = staging.SlotMaps(self.area, self.spec, cuda=self._cuda, device=self._dev.index)
        self._pool = ThreadPoolExecutor(
            hash_threads or min(16, os.cpu_count() or 1), thread_name_prefix="qconvert-refit-digest"
        )
        self._copier = _Copier(self._dev.type == "cuda", self._hash_files)
        self._lock: fs.SlotLock | None = None
        self._reported = 0  # last version this rank reported (sharded) or committed
        self._reset_version()
        self._closed = False

    # ------------------------------------------------------------------ area

    def _open_area(self, headers: dict[str, bytes], extra: dict[str, bytes]) -> None:
        if os.path.lexists(self.area / fs.AREA_JSON):
            self._check_existing()
            if self.rank == 0 and self.world_size > 1:  # a new run: reports of an earlier one do not stand
                for k in fs.SLOTS:
                    for r in range(self.world_size):
                        _unlink(fs.slot_dir(self.area, k) / f".rank-{r}.json")
            return
        if self.rank == 0:
            if os.path.lexists(self.area):
                raise RefitError(
                    f"{self.area}: exists but is not a refit staging area (no {fs.AREA_JSON}); "
                    f"drop it with `qconvert stage drop {self.name}` or choose another name"
                )
            staging.create_area_v2(self.name, self.spec, headers, extra, root=self.root)
            return
        deadline = time.monotonic() + self.rendezvous_timeout_s
        while not os.path.lexists(self.area / fs.AREA_JSON):  # rank 0 creates it
            if time.monotonic() > deadline:
                raise RefitError(
                    f"staging area {self.area}: trainer rank 0 did not create it within "
                    f"{self.rendezvous_timeout_s:g} s; start a Refitter on rank 0"
                )
            time.sleep(0.05)
        self._check_existing()

    def _check_existing(self) -> None:
        have = fs.read_area_spec(self.area)
        if have.digest != self.spec.digest and have.digest in _WRITABLE_DIGESTS:  # an area made by an older qconvert
            import dataclasses

            self.spec = dataclasses.replace(self.spec, digest=have.digest)
        why = have.mismatch(self.spec)
        if why:
            raise RefitError(
                f"staging area {self.area} was created for other weights or options: {why}; "
                f"drop it (`qconvert stage drop {self.name}`) or refit into another name"
            )

    # ------------------------------------------------------------------ one version

    def _reset_version(self) -> None:
        self._version: int | None = None
        self._slot: int | None = None
        self._buffers: dict[tuple, dict[str, torch.Tensor]] = {}
        self._written: set[tuple] = set()
        self._digests: dict[str, list[Future]] = {}
        self._n_in = self._n_out = 0

    def _begin(self) -> None:
        """First stage() of a version: find the slot, drain its readers (its lock)."""
        if self._version is not None:
            return
        deadline = time.monotonic() + self.rendezvous_timeout_s
        while True:
            commit = fs.read_commit(self.area, self.spec)
            have = commit.version if commit else 0
            if have >= self._reported:
                break
            if time.monotonic() > deadline:  # rank 0 has not committed what this rank reported
                raise RefitError(
                    f"staging area {self.area}: version {self._reported} staged by trainer rank "
                    f"{self.rank} was never committed by rank 0 within {self.rendezvous_timeout_s:g} s"
                )
            time.sleep(0.02)
        slot = fs.next_slot(commit)
        if self.world_size > 1:  # a report of this rank from before a crash no longer stands
            _unlink(fs.slot_dir(self.area, slot) / f".rank-{self.rank}.json")
        lock = fs.SlotLock(self.area, slot, shared=False, wait_s=self.lock_wait_s)
        if self.world_size > 1:
            lock.release()  # drained: readers re-check commit.json under their lock (docs/reload.md#sharded-trainers)
        else:
            self._lock = lock
        self._version, self._slot = have + 1, slot

    @ctrl_c_safe
    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Quantize and write ``named_tensors`` (Hugging Face names; this rank's layers, whole
        tensors) into the slot being written. May be called several times before :meth:`commit`.
        Returns the version being staged. On error nothing is committed and the version restarts."""
        self._check_open()
        try:
            self._begin()
            from qconvert.convert import fused

            take, plain = self._take, self._plain
            for name, t in named_tensors:
                if name in plain:  # a reference tensor: no fused-name test per tensor
                    take(name, t)
                    continue
                # transformers 5 models yield fused experts (…experts.gate_up_proj [E, 2I, H]): split per expert
                for n, x in fused.split_stream([(name, t)], self._config, self._views):
                    take(n, x)
            self._copier.finish()
        except BaseException:
            self._abort()
            raise
        return self._version

    def _take(self, name: str, t) -> None:
        spec = self._in_spec.get(name)
        if spec is None:
            raise RefitError(
                f"refit: tensor {name!r} is not in the reference checkpoint {self.reference}; "
                "the trainer's names must be the Hugging Face names"
            )
        if not isinstance(t, torch.Tensor):
            raise RefitError(f"refit: {name} is a {type(t).__name__}, not a torch.Tensor")
        key, want_shape, want_torch_dtype = spec
        if t.dtype is not want_torch_dtype or t.shape != want_shape:
            want_dtype = self._inv[name][0]
            raise RefitError(
                f"refit: {name} is {t.dtype} {list(t.shape)}, the reference has {want_dtype} {list(want_shape)}"
            )
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = {}
        if name in buf or key in self._written:
            raise RefitError(f"refit: tensor {name!r} given twice in one version")
        t = t.detach()
        if t.is_cuda is not self._cuda or not (self._cuda or t.is_cpu):  # (t.device builds an object: 1 us)
            t = t.to(self._dev)
        buf[name] = t
        self._n_in += 1
        if len(buf) == len(self._need[key]):
            self._write_group(key)

    def _write_group(self, key: tuple) -> None:
        src = self._buffers.pop(key)
        plan = self._plans[key]
        check = _finite_check(src, plan.float_names) if self._check_group else None
        dsts = plan.copies(src, self._maps, self._slot)
        del src
        self._n_out += plan.n_out
        self._written.add(key)
        self._copier.put(dsts, plan.file_names, check)

    def _hash_files(self, names: list[str]) -> None:
        """Digest the group's files on the pool as soon as their bytes are in place: a pieces digest
        spreads one large file (the LM head's, at the end of a refit) over the threads."""
        from qconvert.convert.safetensors_io import xxh3_128_piece

        slot = self._slot
        for n in names:
            mm = self._maps.buffer(slot, n)
            if self.spec.digest == fs.DIGEST_XXH3:
                self._digests[n] = [self._pool.submit(_digest_mapping, mm)]
            else:
                self._digests[n] = [self._pool.submit(xxh3_128_piece, mm, a, b) for a, b in fs.digest_pieces(len(mm))]

    def _file_digests(self) -> dict[str, str]:
        from qconvert.convert.safetensors_io import xxh3_128_of_pieces

        if self.spec.digest == fs.DIGEST_XXH3:
            return {n: fut[0].result() for n, fut in self._digests.items()}
        return {n: xxh3_128_of_pieces([f.result() for f in futs]) for n, futs in self._digests.items()}

    def _abort(self) -> None:
        self._copier.drop()
        for futs in self._digests.values():
            for f in futs:
                f.cancel()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._reset_version()

    def _missing(self, keys) -> str:
        names = sorted(s for k in keys for s in self._need[k] - self._buffers.get(k, {}).keys())
        return f"{len(names)} tensors never arrived (e.g. {names[:3]})"

    @ctrl_c_safe
    def commit(self) -> Staged | None:
        """Make the staged version visible (rank 0; other ranks report theirs and return None)."""
        self._check_open()
        if self._version is None:
            raise RefitError("refit: nothing staged since the last commit; call stage() first")
        try:
            partial = [k for k in self._buffers if self._buffers[k]]
            if partial:
                raise RefitError(
                    f"refit: trainer rank {self.rank}: {self._missing(partial)}; a rank sends every "
                    "tensor of the layers it owns"
                    if self.world_size > 1
                    else f"refit: {self._missing(partial)}; send every tensor of the model"
                )
            if self.world_size == 1 and len(self._written) != len(self._keys):
                raise RefitError(
                    f"refit: {self._missing(set(self._keys) - self._written)}; send every tensor of the model"
                )
            digests = self._file_digests()
            groups = sorted(self._gidx[k] for k in self._written)
            if self.world_size > 1:
                report = fs.slot_dir(self.area, self._slot) / f".rank-{self.rank}.json"
                fs.write_json_atomic(report, {"version": self._version, "groups": groups, "digests": digests})
                if self.rank != 0:
                    self._reported = self._version
                    self._reset_version()
                    return None
                digests = self._gather(groups, digests)
            commit = fs.Commit(self._slot, self._version, digests, time.time())
            fs.write_json_atomic(self.area / fs.COMMIT_JSON, commit.to_json())
            if self.world_size > 1:
                for r in range(self.world_size):
                    _unlink(fs.slot_dir(self.area, self._slot) / f".rank-{r}.json")
        except BaseException:
            self._abort()
            raise
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        staged = Staged(
            self.area,
            fs.slot_dir(self.area, commit.slot),
            commit.version,
            commit.slot,
            sum(f.size for f in self.spec.files),
        )
        self._reported = commit.version
        self._reset_version()
        return staged

    def _gather(self, own_groups: list[int], own: dict[str, str]) -> dict[str, str]:
        """Rank 0: every rank's report for this version, checked: each group staged by exactly one rank."""
        deadline = time.monotonic() + self.rendezvous_timeout_s
        reports = {0: {"groups": own_groups, "digests": own}}
        d = fs.slot_dir(self.area, self._slot)
        while len(reports) < self.world_size:
            for r in range(1, self.world_size):
                if r in reports or not os.path.lexists(d / f".rank-{r}.json"):
                    continue
                rep = fs.read_json(d / f".rank-{r}.json")
                if isinstance(rep, dict) and rep.get("version") == self._version:
                    reports[r] = rep
            if len(reports) < self.world_size:
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in reports]
                    raise RefitError(
                        f"refit: trainer rank{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing))} never reported version {self._version} within "
                        f"{self.rendezvous_timeout_s:g} s; nothing committed (the previous version stays)"
                    )
                time.sleep(0.02)
        owner: dict[int, int] = {}
        digests: dict[str, str] = {}
        for r, rep in sorted(reports.items()):
            for g in rep.get("groups", []):
                if g in owner:
                    name = sorted(self._need[self._keys[g]])[0]
                    raise RefitError(
                        f"refit: tensor {name} was staged by trainer ranks {owner[g]} and {r}; each "
                        "layer must come from one rank; nothing committed"
                    )
                owner[g] = r
            digests.update(rep.get("digests", {}))
        none = [k for k in self._keys if self._gidx[k] not in owner]
        if none:
            names = sorted(s for k in none for s in self._need[k])
            raise RefitError(
                f"refit: {len(names)} tensors were staged by no trainer rank (e.g. {names[:3]}); nothing committed"
            )
        want = {f.name for f in self.spec.files}
        if set(digests) != want:
            raise RefitError(
                f"refit: the ranks' reports do not cover the area's files "
                f"(e.g. {sorted(want ^ set(digests))[:2]}); nothing committed"
            )
        return digests

    # ------------------------------------------------------------------ servers

    @ctrl_c_safe
    def reload(self, weight_version: str | None = None) -> list:
        """Reload the committed version into ``urls`` (rank 0; other ranks: nothing to do). vLLM
        servers read the area where it is, through qconvert's worker extension (each rank its own
        files; docs/reload.md#per-rank-files). SGLang servers get the committed slot's directory
        through ``update_weights_from_disk``, by the same call as ``qconvert reload sglang`` of the
        area, which holds that slot's shared lock until SGLang answers
        (docs/reload.md#sglang-disk-update)."""
        self._check_open()
        if self.rank != 0 or not self.urls:
            return []
        kw = dict(weight_version=weight_version, api_key=self.api_key, verify=self.verify)
        if self.engine == "vllm":
            from qconvert.client.vllm_client import reload_vllm

            return reload_vllm(self.urls, str(self.area), pause=self.pause or "wait", **kw)
        from qconvert.client.sglang_client import reload_sglang

        return reload_sglang(self.urls, str(self.area), pause=self.pause or "retract", **kw)

    @ctrl_c_safe
    def refit(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> RefitResult:
        """:meth:`stage`, :meth:`commit`, :meth:`reload`."""
        t0 = time.perf_counter()
        self.stage(named_tensors)
        n_in, n_out = self._n_in, self._n_out
        t1 = time.perf_counter()
        staged = self.commit()
        t2 = time.perf_counter()
        res = RefitResult(staged, tensors_in=n_in, tensors_out=n_out)
        if staged is not None:
            res.reload = self.reload(weight_version or f"v{staged.version}")
        res.seconds = {"stage": t1 - t0, "commit": t2 - t1, "reload": time.perf_counter() - t2}
        return res

    def _check_open(self) -> None:
        if self._closed:
            raise RefitError("refit: this Refitter is closed")

    def close(self) -> None:
        """Release the mappings (and CUDA registrations), the digest threads and any slot lock.
        The area stays (servers keep reading the committed version)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._abort()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._maps.close()

    def __enter__(self) -> Refitter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stack_mxfp8(jobs: list, inv: dict, device: str, check: bool) -> list:
    """Plain MXFP8 jobs of one layer group whose sources share a shape (the experts) merged into
    one stacked job each (jobs.mxfp8_stack_job); every other job as it is."""
    from qconvert.convert.jobs import mxfp8_stack_job

    out, bins = [], {}
    for j in jobs:
        if j.fmt == "mxfp8" and len(j.sources) == 1 and len(j.outputs) == 2:
            key = (staging.group_key(j.sources[0]), inv[j.sources[0]])
            bins.setdefault(key, []).append(j)
        else:
            out.append(j)
    for js in bins.values():
        out.append(js[0] if len(js) == 1 else mxfp8_stack_job(js, device, check))
    return out


def _stack_nvfp4(jobs: list, inv: dict, dialect: str, opts, check: bool) -> list:
    """NVFP4 group jobs of one layer group whose members have the same shapes and dtype (the
    experts' gate/up pairs; their downs) merged into one stacked job each (jobs.nvfp4_stack_job);
    a group alone (q/k/v, a dense gate/up) becomes a stacked job of one, so that its outputs,
    input scales included, are all on the device. Every other job as it is."""
    from qconvert.convert.jobs import nvfp4_stack_job

    out, bins = [], {}
    for j in jobs:
        specs = tuple(inv[s] for s in j.sources)
        if (
            j.nvfp4 is not None
            and all(len(shape) == 2 for _, shape in specs)
            and len({(tag, shape[-1]) for tag, shape in specs}) == 1
        ):
            bins.setdefault((staging.group_key(j.sources[0]), specs), []).append(j)
        else:
            out.append(j)
    for js in bins.values():
        out.append(nvfp4_stack_job(js, dialect, opts, check))
    return out


class _GroupPlan:
    """What a layer group's refit does that does not depend on the values, decided once: its jobs,
    each output's place among the group's byte pieces, and the copies (runs of pieces that lie
    back to back in one file). A stacked job's outputs are pieces of its stacks (jobs.Stacked),
    cut by one ``torch.split`` per stack, so a refit does no Python step per output; the stacks'
    dtypes and shapes are checked, which checks every output's. Other jobs' outputs are checked
    one by one."""

    def __init__(self, jobs: list, files: list, batched: bool, float_names: list[str]):
        from qconvert.convert.jobs import out_nbytes

        self.jobs, self.batched = jobs, batched
        self.file_names = [f.name for f in files]
        self.n_out = sum(len(j.outputs) for j in jobs)
        self.float_names = float_names  # the inputs the NaN/Inf check reads
        piece_of: dict[str, int] = {}
        self.splits: list[list | None] = []  # per job: per stack, the piece sizes in byte order
        owner: list[int] = []  # per piece: the index of the tensor (stack or output) it comes from
        n_src = 0
        for j in jobs:
            st = getattr(j, "stacked", None)
            if st is None:
                self.splits.append(None)
                for o in j.outputs:
                    piece_of[o.name] = len(owner)
                    owner.append(n_src)
                    n_src += 1
                continue
            per_stack: list[list] = [[] for _ in st.stacks]
            for o, (k, off) in zip(j.outputs, st.tiles):
                per_stack[k].append((off, o.name, out_nbytes(o)))
            sizes = []
            for tiles in per_stack:
                cut: dict[int, int] = {}  # tile offset -> its piece (outputs of one tile share it)
                lengths = []
                for off, name, n in sorted(tiles):
                    if off not in cut:
                        cut[off] = len(owner)
                        owner.append(n_src)
                        lengths.append(n)
                    piece_of[name] = cut[off]
                sizes.append(lengths)
                n_src += 1
            self.splits.append(sizes)
        self.n_pieces, self.n_src = len(owner), n_src
        # per file: runs (start, end, piece indices, the tensors they come from)
        self.files: list[tuple[str, list]] = []
        for f in files:
            runs: list = []
            end = None
            for n, spec in sorted(f.tensors.items(), key=lambda x: x[1].offset):
                if n not in piece_of:
                    raise RefitError(f"refit: internal: {n} is in {f.name} but no job of its layer writes it")
                if runs and batched and spec.offset == end:
                    runs[-1][1] = spec.offset + spec.nbytes
                    runs[-1][2].append(piece_of[n])
                else:
                    runs.append([spec.offset, spec.offset + spec.nbytes, [piece_of[n]]])
                end = spec.offset + spec.nbytes
            self.files.append((f.name, [(a, b, p, sorted({owner[i] for i in p})) for a, b, p in runs]))
        self.owner = owner

    def copies(self, src: dict, maps, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run the group's jobs on ``src``: (destination slice of a file, source bytes) per copy."""
        pieces: list[torch.Tensor] = []
        devs: list = []  # per tensor pieces come from: its device
        res = None
        for j, sizes in zip(self.jobs, self.splits):
            sub = {s: src[s] for s in j.sources}
            if sizes is None:
                res = j.fn(sub)
                for o in j.outputs:
                    t = res[o.name]
                    if t.shape != o.shape or t.dtype != o.dtype:
                        raise RefitError(
                            f"refit: {o.name} came out {t.dtype} {list(t.shape)}, expected {o.dtype} {list(o.shape)}"
                        )
                    pieces.append((t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8))
                    devs.append(t.device)
                continue
            st = j.stacked
            stacks = st.fn(sub)
            if len(stacks) != len(st.stacks):
                raise RefitError(f"refit: internal: {j.outputs[0].name}'s job gave {len(stacks)} stacks")
            for t, (dtype, shape), cut in zip(stacks, st.stacks, sizes):
                if t.dtype != dtype or t.shape != shape:
                    name = next(o.name for o, (k, _) in zip(j.outputs, st.tiles) if st.stacks[k] == (dtype, shape))
                    raise RefitError(
                        f"refit: the stack holding {name} came out {t.dtype} {list(t.shape)}, "
                        f"expected {dtype} {list(shape)}"
                    )
                pieces.extend(torch.split(t.reshape(-1).view(torch.uint8), cut))
                devs.append(t.device)
        del res
        dsts = []
        for fname, runs in self.files:
            whole = maps.tensor(slot, fname)
            for start, end, idx, srcs in runs:
                if len(idx) == 1:
                    dsts.append((whole[start:end], pieces[idx[0]]))
                elif len({devs[i] for i in srcs}) == 1:
                    dsts.append((whole[start:end], torch.cat([pieces[i] for i in idx])))
                else:  # pieces on several devices: a copy per stretch on one device
                    run: list = []
                    for i in idx:
                        if run and devs[self.owner[run[-1]]] != devs[self.owner[i]]:
                            dsts.append(_copy_of(whole, start, run, pieces))
                            start += sum(pieces[r].numel() for r in run)
                            run = []
                        run.append(i)
                    dsts.append(_copy_of(whole, start, run, pieces))
        return dsts


def _copy_of(whole: torch.Tensor, start: int, run: list[int], pieces: list) -> tuple[torch.Tensor, torch.Tensor]:
    src = pieces[run[0]] if len(run) == 1 else torch.cat([pieces[i] for i in run])
    return whole[start : start + src.numel()], src


def _has_floats(spec) -> bool:
    _, shape, dtype = spec
    return dtype is not None and dtype.is_floating_point and shape.numel() > 0


def _finite_check(src: dict[str, torch.Tensor], names: list[str]):
    """Refuse NaN/Inf in a layer group's inputs without a host sync per group: the L1 norm of each
    tensor (torch._foreach_norm, a few launches for all of them, in fp32) is NaN or inf if the
    tensor holds NaN or Inf. On CUDA the flags travel to page-locked memory on the compute stream,
    ahead of the group's quantization, so they have landed once the group's copies are done: the
    returned callable, run then, raises for a flagged tensor (one flagged only because its finite
    values overflow the sum is checked exactly). The version is refused at that point, before
    anything is committed. ``names``: the group's floating-point inputs with elements, sorted."""
    if not names:
        return None
    inputs = [src[n] for n in names]  # kept until the check ran: the exact re-check reads them
    norms = torch._foreach_norm(inputs, 1, dtype=torch.float32)
    flags = torch.isfinite(torch.stack(norms))
    landed = None
    if flags.is_cuda:
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        flags, landed = host, torch.cuda.Event()
        landed.record()

    def check() -> None:
        from qconvert.convert.jobs import non_finite_error

        if landed is not None:  # done already when the group's copies are (they were queued after it)
            landed.synchronize()
        if bool(flags.all()):
            return
        for n, x, ok in zip(names, inputs, flags.tolist()):
            if not ok and not bool(torch.isfinite(x).all()):
                raise non_finite_error(n)

    return check


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


_WRITABLE_DIGESTS = (fs.DIGEST_XXH3_PIECES, fs.DIGEST_XXH3)


def _digest_mapping(mm) -> str:
    from qconvert.convert.safetensors_io import xxh3_128_hex

    view = memoryview(mm)
    try:
        return xxh3_128_hex(view)
    finally:
        view.release()


# ---------------------------------------------------------------------- the one-call functions


@ctrl_c_safe
def stage_refit(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    reference: str | os.PathLike,
    stage_name: str,
    options=None,
    root: Path | None = None,
) -> RefitResult:
    """Quantize ``named_tensors`` with the converter's plan for ``reference`` and stage them as a
    committed version of ``stage_name`` (a :class:`Refitter` made, used once and closed)."""
    with Refitter(reference, options, stage_name, root=root) as r:
        r.stage(named_tensors)
        n_in, n_out = r._n_in, r._n_out
        return RefitResult(r.commit(), tensors_in=n_in, tensors_out=n_out)


@ctrl_c_safe
def refit(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    reference: str | os.PathLike,
    urls: list[str],
    engine: str = "vllm",
    stage_name: str = "refit",
    options=None,
    weight_version: str | None = None,
    api_key: str | None = None,
    pause: str | None = None,
    verify: bool = False,
    root: Path | None = None,
) -> RefitResult:
    """Quantize and stage (see :func:`stage_refit`), then reload the staging area into ``urls``."""
    with Refitter(
        reference, options, stage_name, urls, engine, root=root, api_key=api_key, pause=pause, verify=verify
    ) as r:
        return r.refit(named_tensors, weight_version)
