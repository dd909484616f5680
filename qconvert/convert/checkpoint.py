"""Source checkpoints: resolve a directory or Hub repo id, validate config, index and shards."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError
from ..formats.dialects import HF_QUANT_CONFIG
from ..formats.manifest import MANIFEST_NAME, layout_section
from .safetensors_io import Header, TensorEntry, file_kind, open_regular, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Files of a source checkpoint that are rewritten, not copied.
REWRITTEN = {"config.json", INDEX_NAME, HF_QUANT_CONFIG, MANIFEST_NAME}


@dataclass
class Checkpoint:
    root: Path
    config: dict
    shards: list[Header]  # in index order (sorted shard names)
    source_id: str  # what the user typed (path or repo id)
    revision: str | None = None
    extra_files: list[Path] = field(default_factory=list)  # copied verbatim (inside root, subfolders too)
    extra_dirs: list[Path] = field(default_factory=list)  # folders of root created in the output (empty ones too)

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        out = {}
        for h in self.shards:
            out.update(h.entries)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for h in self.shards for e in h.entries.values())

    def shard_of(self) -> dict[str, int]:
        return {name: i for i, h in enumerate(self.shards) for name in h.entries}


def resolve_source(src: str, allow_download: bool = True) -> tuple[Path, str | None]:
    """A local directory, else a Hugging Face repo id through huggingface_hub (cache, HF_HUB_OFFLINE)."""
    p = Path(src).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"{p}: SRC must be a checkpoint directory (with config.json), not a file")
        return p, None
    looks_like_repo = src.count("/") == 1 and not src.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise CheckpointError(
            f"{src}: no such directory; pass a local checkpoint directory or a Hub repo id like org/name"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover
        raise CheckpointError("huggingface_hub is not installed; pip install huggingface_hub") from None
    try:
        path = snapshot_download(
            src,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.md", "*.tiktoken", "*.py"],
            local_files_only=not allow_download or os.environ.get("HF_HUB_OFFLINE") == "1",
        )
    except Exception as e:  # HTTP errors, LocalEntryNotFoundError, network errors
        from ..hub_errors import hub_error_line

        raise CheckpointError(f"{src}: not a local directory, and not downloaded: {hub_error_line(e)}") from None
    rev = Path(path).name
    return Path(path), rev


def _safe_member(root: Path, rel: str, index_path: Path) -> Path:
    if (
        not isinstance(rel, str)
        or not rel
        or os.path.isabs(rel)
        or "\\" in rel
        or any(part in ("..", "") for part in rel.split("/"))
    ):
        raise CheckpointError(
            f"{index_path}: shard name {rel!r} is not a plain file name inside the checkpoint; refusing to read outside SRC"
        )
    # Checked lexically: Hub cache snapshots are symlinks into a blob store, so resolving is wrong.
    return root / rel


def _check_inside(root: Path, p: Path, hub: bool):
    """Refuse a file (symlink) that resolves outside SRC; a Hub snapshot may point into its blob store."""
    base = root.resolve()
    if hub and len(base.parents) >= 2:
        base = base.parents[1]  # <cache>/models--org--name: holds snapshots/<rev>/ and blobs/
    try:
        p.resolve().relative_to(base)
    except ValueError:
        raise CheckpointError(
            f"{p}: is a symlink that resolves outside {root}; refusing to read outside SRC "
            "(copy the file into the checkpoint directory)"
        ) from None


def guard(root: str | os.PathLike, p: str | os.PathLike, hub: bool = False) -> Path:
    """The one guarded way to name a file of a checkpoint before reading it: ``p`` must stay inside
    ``root`` once symlinks are resolved (a symlink inside the root that points inside the root is
    fine; a Hub snapshot may point into its own blob store) and must be a regular file. Anything
    else is a one-line CheckpointError naming the file. Returns ``p``; open it with
    :func:`open_member` (or :func:`safetensors_io.open_regular`), which refuses a FIFO or device
    swapped in since."""
    root, p = Path(root), Path(p)
    _check_inside(root, p, hub)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{p}: not found (a dangling symlink?); restore the file") from None
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{p}: is {file_kind(mode)}, not a regular file; put the real file there")
    return p


def open_member(root: str | os.PathLike, p: str | os.PathLike, hub: bool = False):
    """:func:`guard` then open for binary reading (a regular file only: no hang on a FIFO)."""
    return open_regular(guard(root, p, hub))


def read_member(root: str | os.PathLike, p: str | os.PathLike, hub: bool = False) -> bytes:
    """The bytes of a guarded checkpoint file (a small one: config, tokenizer, index)."""
    with open_member(root, p, hub) as f:
        return f.read()


def read_member_json(root: str | os.PathLike, p: str | os.PathLike, hub: bool = False):
    """Parsed JSON of a guarded checkpoint file (ValueError / UnicodeDecodeError as json raises them)."""
    return json.loads(read_member(root, p, hub).decode("utf-8"))


#: Weights of other frameworks or formats, never copied into the output (wherever they are).
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".onnx", ".onnx_data", ".gguf", ".h5", ".msgpack", ".tflite", ".ot")
#: Top-level folders that hold exports of the same weights in other formats (not copied).
OTHER_EXPORT_DIRS = {"onnx", "openvino", "original", "coreml"}


def extra_members(root: Path, hub: bool = False, dirs: list[Path] | None = None) -> list[Path]:
    """Every file of the checkpoint that is copied into the output verbatim: all files and
    folders of ``root`` (e.g. sentence-transformers' ``1_Pooling/``) except the weights being
    converted (top-level ``*.safetensors`` and pickles), the files qconvert rewrites
    (:data:`REWRITTEN`, weight indexes), hidden entries (``.cache``, ``.git``), ``*.lock``, weights
    in other formats (:data:`OTHER_WEIGHT_SUFFIXES`; a subfolder's ``.safetensors`` / ``.bin``,
    e.g. a sentence-transformers ``2_Dense/``, is copied) and exports in :data:`OTHER_EXPORT_DIRS`.
    Every entry is checked with :func:`guard`: a symlink that leaves ``root`` is an error, a
    symlinked folder inside it is followed once (no cycles)."""
    out: list[Path] = []
    seen = {root.resolve()}

    def walk(d: Path, top: bool):
        for p in sorted(d.iterdir()):
            name = p.name
            if name.startswith(".") or name.endswith(".lock"):
                continue
            if top and (
                name in REWRITTEN or name.endswith((".safetensors", ".index.json")) or name in OTHER_EXPORT_DIRS
            ):
                continue
            _check_inside(root, p, hub)
            if p.is_dir():
                real = p.resolve()
                if real not in seen:
                    seen.add(real)
                    if dirs is not None:
                        dirs.append(p)
                    walk(p, False)
                continue
            if name.endswith(OTHER_WEIGHT_SUFFIXES if top else OTHER_WEIGHT_SUFFIXES[3:]):
                continue
            out.append(guard(root, p, hub))

    walk(root, True)
    return out


# ---- the one checkpoint-directory reader -------------------------------------------------------

CONFIG_NAME = "config.json"


class Problem(str):
    """One consistency problem of a checkpoint directory: the one-line text (a ``str``, so reports
    print it as is), ``code``, what decisions are taken on (:data:`PROBLEM_CODES`), and
    ``subject``, the tensor or file it is about."""

    code: str
    subject: str

    def __new__(cls, code: str, text: str, subject: str = ""):
        obj = super().__new__(cls, text)
        obj.code, obj.subject = code, subject
        return obj

    def __reduce__(self):
        return Problem, (self.code, str(self), self.subject)


#: Problem codes. Strict mode raises on the first problem whose code is in :data:`FATAL_STRICT`
#: (what convert refuses); lenient mode (inspect, verify, staging, reload) collects every one.
PROBLEM_CODES = (
    "duplicate",  # a tensor stored in two shards
    "index-missing-tensor",  # the index lists a tensor that its shard does not hold
    "index-wrong-shard",  # the index lists a tensor in another shard than the one holding it
    "not-in-index",  # a shard holds a tensor the index does not list
    "unlisted-shard",  # a top-level .safetensors file the index does not list (engines skip it)
    "no-index",  # several .safetensors files and no index
    "total-size",  # the index's metadata.total_size is not the tensors' byte count
)
FATAL_STRICT = frozenset({"duplicate", "index-missing-tensor", "index-wrong-shard", "not-in-index", "no-index"})

_UNREAD = object()


def _json_member(root: Path, p: Path, what: str, hub: bool = False) -> dict:
    """A guarded JSON object file of the checkpoint; one-line CheckpointError otherwise."""
    try:
        obj = read_member_json(root, p, hub)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: not valid JSON ({e}); restore the {what}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{p}: {what} must be a JSON object; restore it")
    return obj


def read_config(root: str | os.PathLike, hub: bool = False) -> dict:
    """``config.json`` of a checkpoint directory (guarded, a JSON object)."""
    root = Path(root)
    p = root / CONFIG_NAME
    if not os.path.lexists(p):  # present but not a regular file: the guarded read says what it is
        raise CheckpointError(f"{p}: missing; a Hugging Face checkpoint needs config.json beside its weights")
    return _json_member(root, p, CONFIG_NAME, hub)


def _optional_json(root: Path, name: str, hub: bool = False) -> dict | None:
    p = root / name
    return _json_member(root, p, name, hub) if os.path.lexists(p) else None


def read_manifest(root: str | os.PathLike) -> dict | None:
    """qconvert's manifest of a checkpoint directory, None when it has none (not written by
    qconvert); a corrupt one, a link out of ``root`` or a FIFO is a one-line CheckpointError."""
    return _optional_json(Path(root), MANIFEST_NAME)


#: the manifest's ``layout`` section (the kernel-layout contract of a pre-shuffled checkpoint),
#: None when there is none (formats.manifest.layout_section)
manifest_layout = layout_section


@dataclass
class CheckpointDir:
    """A checkpoint directory as :func:`open_checkpoint` read it: config, index, every shard's
    validated header, and the problems found. ``hf_quant_config`` and ``manifest`` are read (guarded)
    on first use: a corrupt one is an error of the caller that needs it."""

    root: Path
    config: dict
    index: dict | None  # the parsed index (its weight_map checked), None without one
    shards: list[Header]  # in index order (sorted shard names), else sorted file names
    tensors: dict[str, TensorEntry]  # name -> entry; a duplicate keeps its first shard's
    shard_of: dict[str, str]  # tensor name -> shard file name
    problems: list[Problem] = field(default_factory=list)
    hub: bool = False
    _hf_quant_config: object = field(default=_UNREAD, repr=False)
    _manifest: object = field(default=_UNREAD, repr=False)

    @property
    def hf_quant_config(self) -> dict | None:
        if self._hf_quant_config is _UNREAD:
            self._hf_quant_config = _optional_json(self.root, HF_QUANT_CONFIG, self.hub)
        return self._hf_quant_config

    @property
    def manifest(self) -> dict | None:
        if self._manifest is _UNREAD:
            self._manifest = _optional_json(self.root, MANIFEST_NAME, self.hub)
        return self._manifest

    @property
    def layout(self) -> dict | None:
        return manifest_layout(self.manifest)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())

    def extra_files(self, dirs: list[Path] | None = None) -> list[Path]:
        """The files convert copies verbatim (:func:`extra_members`), shards excluded."""
        shard_paths = {h.path.resolve() for h in self.shards}
        return [p for p in extra_members(self.root, self.hub, dirs) if p.resolve() not in shard_paths]


def open_checkpoint(
    root: str | os.PathLike, strict: bool = True, hub: bool = False, require_config: bool = True
) -> CheckpointDir:
    """The one reader of a checkpoint directory (every file through :func:`guard`: nothing outside
    ``root``, no FIFO): config.json, the index, every shard's validated header.

    Always an error: no directory, config.json missing or not a JSON object, a malformed index, an
    index naming a shard outside ``root`` or a missing one, no ``.safetensors`` file. The
    directory's consistency problems (:data:`PROBLEM_CODES`) are collected in ``problems``;
    ``strict`` (what convert requires) raises the first of :data:`FATAL_STRICT`, and also refuses
    pickle-only and tensor-less checkpoints. ``hub``: ``root`` is a Hub cache snapshot, whose links
    may point into its blob store. ``require_config=False`` (a directory read for some tensors only,
    ``--input-scales-from``): no config.json needed (``config`` is then ``{}``).
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise CheckpointError(
            f"{root}: not a checkpoint directory; pass a directory holding config.json and *.safetensors"
        )
    config = read_config(root, hub) if require_config else {}
    ck = CheckpointDir(root, config, None, [], {}, {}, hub=hub)
    problems = ck.problems
    index_path = root / INDEX_NAME
    on_disk = sorted(p.name for p in root.glob("*.safetensors"))
    if os.path.lexists(index_path):
        try:
            index = read_member_json(root, index_path, hub)
            if not isinstance(index, dict):
                raise ValueError("not a JSON object")
            wmap = index["weight_map"]
            if not isinstance(wmap, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
            ):
                raise ValueError("weight_map must map tensor names to shard file names")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index_path}: malformed index ({e}); rewrite or re-download it") from None
        ck.index = index
        files = sorted(set(wmap.values()))
        for rel in files:
            _check_inside(root, _safe_member(root, rel, index_path), hub)
        for rel in files:
            if not os.path.lexists(root / rel):  # a FIFO or link: guard() below says what it is
                raise CheckpointError(
                    f"{root / rel}: shard listed in {INDEX_NAME} is missing; "
                    "re-download the checkpoint (or re-run the conversion)"
                )
        listed = {Path(rel).name for rel in files if "/" not in rel}
        for extra in on_disk:
            if extra not in listed:
                problems.append(
                    Problem(
                        "unlisted-shard",
                        f"{root / extra}: shard not listed in {INDEX_NAME}; engines will "
                        "not load it — delete it or add it to the index",
                        extra,
                    )
                )
    else:
        files = on_disk
        if len(files) > 1:
            problems.append(
                Problem(
                    "no-index",
                    f"{root}: {len(files)} .safetensors files but no {INDEX_NAME}; add the index or keep one file",
                    INDEX_NAME,
                )
            )
    if not files and (ck.index is None or not strict):  # strict: an empty index is an empty model (below)
        if strict:
            pickles = sorted(list(root.glob("*.bin")) + list(root.glob("*.pt")) + list(root.glob("*.pth")))
            if pickles:
                raise CheckpointError(
                    f"{pickles[0]}: pickle checkpoints can execute code and are refused; convert to safetensors first "
                    "(e.g. transformers' save_pretrained(safe_serialization=True)) or pass --allow-pickle"
                )
        raise CheckpointError(f"{root}: no .safetensors weights found")
    if strict and any(p.code in FATAL_STRICT for p in problems):
        raise CheckpointError(next(p for p in problems if p.code in FATAL_STRICT))
    ck.shards = [read_header(guard(root, root / rel, hub)) for rel in files]
    for h in ck.shards:
        for name, e in h.entries.items():
            if name in ck.tensors:
                problems.append(
                    Problem(
                        "duplicate",
                        f"tensor {name!r} appears in both {ck.shard_of[name]} and "
                        f"{h.path.name}; the checkpoint is inconsistent: remove one copy",
                        name,
                    )
                )
                continue
            ck.tensors[name] = e
            ck.shard_of[name] = h.path.name
    if ck.index is not None:
        wmap = ck.index["weight_map"]
        for name, rel in sorted(wmap.items()):
            if name not in ck.tensors:
                problems.append(
                    Problem(
                        "index-missing-tensor",
                        f"{index_path}: tensor {name!r} listed in {rel} but that "
                        "shard does not hold it; rewrite the index or re-download",
                        name,
                    )
                )
            elif ck.shard_of[name] != Path(rel).name:
                problems.append(
                    Problem(
                        "index-wrong-shard",
                        f"{index_path}: tensor {name!r} listed in {rel} but stored "
                        f"in {ck.shard_of[name]}; rewrite the index",
                        name,
                    )
                )
        for name in sorted(set(ck.tensors) - set(wmap)):
            problems.append(
                Problem(
                    "not-in-index",
                    f"{index_path}: tensor {name!r} in {ck.shard_of[name]} is not in the index; rewrite the index",
                    name,
                )
            )
        meta = ck.index.get("metadata")
        total = meta.get("total_size") if isinstance(meta, dict) else None
        if total is not None and total != ck.total_bytes:
            problems.append(
                Problem(
                    "total-size",
                    f"{index_path}: metadata.total_size {total} != {ck.total_bytes} "
                    "bytes of tensor data; rewrite the index",
                    INDEX_NAME,
                )
            )
    if strict:
        fatal = [p for p in problems if p.code in FATAL_STRICT]
        if fatal:
            raise CheckpointError(fatal[0])
        if not ck.tensors:
            raise CheckpointError(f"{root}: the checkpoint holds no tensors (empty model)")
    return ck


def load_checkpoint(
    src: str, allow_download: bool = True, allow_pickle: bool = False, decode: bool = False
) -> Checkpoint:
    """What convert reads: SRC resolved (directory or Hub id), read strictly (:func:`open_checkpoint`),
    not already quantized, with the files copied verbatim into the output. ``decode``: an MXFP4
    source is checked but not refused (``qconvert bf16`` and ``verify`` decode it,
    docs/formats.md#quantized-sources-decoded-to-bf16)."""
    root, rev = resolve_source(src, allow_download)
    ck = open_checkpoint(root, strict=True, hub=rev is not None)
    config = ck.config
    from . import mxfp4_source
    from .fp8_source import declaration

    # an MXFP4 source (gpt-oss): bad tensors named, then refused (docs/formats.md#mxfp4-sources)
    inventory = {n: (e.dtype, e.shape) for n, e in ck.tensors.items()}
    if not decode:
        mxfp4_source.check(config, inventory, ck.root / CONFIG_NAME)
    if mxfp4_source.detect(config, inventory, ck.root / CONFIG_NAME) is None:
        declaration(
            config, ck.root / CONFIG_NAME
        )  # raises unless BF16 or FP8 block-scaled (docs/formats.md#fp8-block-sources)
    dirs: list[Path] = []
    extra = ck.extra_files(dirs)
    return Checkpoint(
        root=root, config=config, shards=ck.shards, source_id=src, revision=rev, extra_files=extra, extra_dirs=dirs
    )


PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def pickle_files(src: str) -> list[Path]:
    """The pickle weight files of a local checkpoint that has no safetensors, else []."""
    root = Path(src).expanduser()
    if not root.is_dir() or any(root.glob("*.safetensors")):
        return []
    # guarded: a .bin symlink that leaves SRC is an error, a FIFO one too (torch.load would block)
    return sorted(
        guard(root, p)
        for p in root.iterdir()
        if p.suffix in PICKLE_SUFFIXES
        and not p.is_dir()
        and not p.name.startswith(("optimizer", "scheduler", "training_args", "rng_state"))
    )


def pickle_to_safetensors(src: str, out: Path) -> Path:
    """``--allow-pickle``: rewrite a .bin/.pt checkpoint as safetensors in ``out``.

    Each file is read with ``torch.load(weights_only=True)``, PyTorch's restricted unpickler,
    which builds tensors and plain containers only and refuses any other object (so a
    checkpoint cannot run code); every value must be a tensor. Other files are copied.
    """
    import shutil

    import torch

    from .safetensors_io import ShardWriter

    root = Path(src).expanduser()
    files = pickle_files(src)
    out.mkdir(parents=True)
    n = len(files)
    wmap = {}
    total = 0
    for i, f in enumerate(files):
        try:
            with open_member(root, f) as fh:
                sd = torch.load(fh, map_location="cpu", weights_only=True, mmap=False)
        except CheckpointError:
            raise
        except Exception as e:  # UnpicklingError for anything but tensors and containers
            msg = str(e).splitlines()[0][:160] if str(e) else e.__class__.__name__
            raise CheckpointError(
                f"{f}: refused by torch.load(weights_only=True): {msg}; it is not a plain tensor checkpoint"
            ) from None
        if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
            sd = sd["state_dict"]
        if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
            raise CheckpointError(f"{f}: expected a dict of name -> tensor (a state dict); got {type(sd).__name__}")
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {k: v.detach().contiguous().clone() for k, v in sd.items()}
        del sd
        w = ShardWriter(out / name, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
        for k, v in tensors.items():
            if k in wmap:
                raise CheckpointError(f"tensor {k!r} appears in two pickle files; the checkpoint is inconsistent")
            w.write(k, v)
            wmap[k] = name
            total += v.numel() * v.element_size()
        w.close(fsync=False)
    if n > 1:
        (out / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, indent=2)
        )
    # config.json and every file convert copies (extra_members, guarded), folders included
    cfg = [guard(root, root / "config.json")] if os.path.lexists(root / "config.json") else []
    dirs: list[Path] = []
    extra = extra_members(root, dirs=dirs)
    for d in dirs:
        (out / d.relative_to(root)).mkdir(parents=True, exist_ok=True)
    for p in cfg + extra:
        dest = out / p.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dest)
    return out
