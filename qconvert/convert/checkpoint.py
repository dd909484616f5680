"""Source checkpoints: resolve a directory or Hub repo id, validate config, index and shards."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError
from ..formats.dialects import HF_QUANT_CONFIG
from ..formats.manifest import MANIFEST_NAME
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
        raise CheckpointError(f"{src}: no such directory; pass a local checkpoint directory or a Hub repo id like org/name")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover
        raise CheckpointError("huggingface_hub is not installed; pip install huggingface_hub") from None
    try:
        path = snapshot_download(
            src, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.md", "*.tiktoken", "*.py"],
            local_files_only=not allow_download or os.environ.get("HF_HUB_OFFLINE") == "1",
        )
    except Exception as e:  # HTTP errors, LocalEntryNotFoundError, network errors
        from ..hub import hub_error_line

        raise CheckpointError(f"{src}: not a local directory, and not downloaded: {hub_error_line(e)}") from None
    rev = Path(path).name
    return Path(path), rev


def _safe_member(root: Path, rel: str, index_path: Path) -> Path:
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\\" in rel or any(
            part in ("..", "") for part in rel.split("/")):
        raise CheckpointError(f"{index_path}: shard name {rel!r} is not a plain file name inside the checkpoint; refusing to read outside SRC")
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
        raise CheckpointError(f"{p}: is a symlink that resolves outside {root}; refusing to read outside SRC "
                              "(copy the file into the checkpoint directory)") from None


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


def read_member_json(root: str | os.PathLike, p: str | os.PathLike, hub: bool = False):
    """Parsed JSON of a guarded checkpoint file (ValueError / UnicodeDecodeError as json raises them)."""
    with open_member(root, p, hub) as f:
        return json.loads(f.read().decode("utf-8"))


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
            if top and (name in REWRITTEN or name.endswith((".safetensors", ".index.json")) or name in OTHER_EXPORT_DIRS):
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


def load_checkpoint(src: str, allow_download: bool = True, allow_pickle: bool = False) -> Checkpoint:
    root, rev = resolve_source(src, allow_download)
    hub = rev is not None
    cfg_path = root / "config.json"
    if not os.path.lexists(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing; a Hugging Face checkpoint needs config.json beside its weights")
    try:
        config = read_member_json(root, cfg_path, hub)
        if not isinstance(config, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e}); restore the original config.json") from None
    if "quantization_config" in config:
        qm = config["quantization_config"].get("quant_method") if isinstance(config["quantization_config"], dict) else None
        raise CheckpointError(f"{cfg_path}: checkpoint is already quantized (quant_method={qm!r}); qconvert converts BF16 checkpoints")

    index_path = root / INDEX_NAME
    if os.path.lexists(index_path):
        try:
            index = read_member_json(root, index_path, hub)
            wmap = index["weight_map"]
            if not isinstance(wmap, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
                raise ValueError("weight_map must map tensor names to shard file names")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index_path}: malformed index ({e}); re-download it") from None
        shard_names = sorted(set(wmap.values()))
        for rel in shard_names:
            _check_inside(root, _safe_member(root, rel, index_path), hub)
        shards = []
        for rel in shard_names:
            p = root / rel
            if not os.path.lexists(p):
                raise CheckpointError(f"{p}: shard listed in {INDEX_NAME} is missing; re-download the checkpoint")
            shards.append(read_header(guard(root, p, hub)))
        seen: dict[str, Path] = {}
        for h in shards:
            for name in h.entries:
                if name in seen:
                    raise CheckpointError(f"tensor {name!r} appears in both {seen[name].name} and {h.path.name}; the checkpoint is inconsistent")
                seen[name] = h.path
        for name, rel in wmap.items():
            if name not in seen:
                raise CheckpointError(f"{index_path}: tensor {name!r} is listed in {rel} but that shard does not hold it; re-download the checkpoint")
            if seen[name].name != Path(rel).name:
                raise CheckpointError(f"{index_path}: tensor {name!r} is listed in {rel} but stored in {seen[name].name}")
        unlisted = [n for n in seen if n not in wmap]
        if unlisted:
            raise CheckpointError(f"{index_path}: tensor {unlisted[0]!r} in {seen[unlisted[0]].name} is not in the index; re-download the index")
    else:
        files = sorted(root.glob("*.safetensors"))
        if len(files) == 1:
            shards = [read_header(guard(root, files[0], hub))]
        elif len(files) > 1:
            raise CheckpointError(f"{root}: {len(files)} .safetensors files but no {INDEX_NAME}; add the index or keep one file")
        else:
            pickles = sorted(list(root.glob("*.bin")) + list(root.glob("*.pt")) + list(root.glob("*.pth")))
            if pickles:
                raise CheckpointError(
                    f"{pickles[0]}: pickle checkpoints can execute code and are refused; convert to safetensors first "
                    "(e.g. transformers' save_pretrained(safe_serialization=True)) or pass --allow-pickle")
            raise CheckpointError(f"{root}: no .safetensors weights found")
    if not any(h.entries for h in shards):
        raise CheckpointError(f"{root}: the checkpoint holds no tensors (empty model)")

    shard_paths = {h.path.resolve() for h in shards}
    dirs: list[Path] = []
    extra = [p for p in extra_members(root, hub, dirs) if p.resolve() not in shard_paths]
    return Checkpoint(root=root, config=config, shards=shards, source_id=src, revision=rev, extra_files=extra,
                      extra_dirs=dirs)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def pickle_files(src: str) -> list[Path]:
    """The pickle weight files of a local checkpoint that has no safetensors, else []."""
    root = Path(src).expanduser()
    if not root.is_dir() or any(root.glob("*.safetensors")):
        return []
    # guarded: a .bin symlink that leaves SRC is an error, a FIFO one too (torch.load would block)
    return sorted(guard(root, p) for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES and not p.is_dir()
                  and not p.name.startswith(("optimizer", "scheduler", "training_args", "rng_state")))


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
            raise CheckpointError(f"{f}: refused by torch.load(weights_only=True): {msg}; "
                                  "it is not a plain tensor checkpoint") from None
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
        (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(wmap.items()))}, indent=2))
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

