"""Checkpoints: convert HF / GGUF sources to Orbax, and load any of the three into a model.

A converted checkpoint is a directory:
  model_config.json   our ModelConfig
  weights/            an Orbax checkpoint of a flat dict {key: array}, keys as in
                      `Decoder` (e.g. "layers.0.attn.q_proj.weight"), weights (out, in)
  tokenizer.json, tokenizer_config.json, ...  copied (HF) or rebuilt (GGUF)

Conversion streams: tensors are read one at a time and written with Orbax
partial saves in groups of at most GROUP_BYTES, so peak memory tracks the
largest tensor, not the model. Everything is written to a temporary directory
beside OUT and renamed into place at the end, so a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_source import GGUFSource
from jaxinfer.hf_source import HFSource
from jaxinfer.models import Decoder

GROUP_BYTES = 64 << 20
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
CONFIG_FILE, WEIGHTS_DIR = "model_config.json", "weights"


def _ocp():
    from orbax.checkpoint.experimental import v1 as ocp
    return ocp


def open_source(path: str | Path) -> HFSource | GGUFSource:
    """An HF directory or a .gguf file (not a converted checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise JaxinferError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix != ".gguf":
            raise JaxinferError(f"{path}: not a .gguf file or a model directory")
        return GGUFSource(path)
    if not (path / "config.json").exists():
        raise JaxinferError(f"{path}: no config.json (not an HF model directory)")
    return HFSource(path)


def is_converted(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape, from the model definition itself (nothing allocated)."""
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    return {_key(path): tuple(v.shape) for path, v in nnx.state(model, nnx.Param).flat_state()}


def _key(path) -> str:
    return ".".join(str(p) for p in path)


def _checked_tensors(source, config: ModelConfig, dtype, want: dict | None = None):
    """Source tensors cast to dtype, each checked against the model's shape; all must appear."""
    want = want or expected_shapes(config)
    seen = set()
    for key, array, file in source.tensors():
        if key not in want:
            if key == "lm_head" and config.tie_word_embeddings:
                continue  # some tied checkpoints still carry a copy
            raise JaxinferError(f"{file}: tensor {key} is not used by a {config.family} model "
                                "with this config")
        if tuple(array.shape) != want[key]:
            raise JaxinferError(f"{file}: tensor {key} has shape {tuple(array.shape)}, "
                                f"the config implies {want[key]}")
        seen.add(key)
        yield key, np.asarray(array).astype(dtype)
    missing = sorted(set(want) - seen)
    if missing:
        raise JaxinferError(f"{source.path}: checkpoint is missing {len(missing)} tensors "
                            f"(first: {missing[0]})")


def convert(src: str | Path, out: str | Path, dtype: str = "bfloat16",
            progress: bool = True) -> Path:
    """Converts an HF directory or GGUF file to a jaxinfer (Orbax) checkpoint directory."""
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise JaxinferError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists():
        raise JaxinferError(f"{out}: already exists (remove it or pick another output)")
    source = open_source(src)
    config = source.config
    tokenizer_files = source.tokenizer_files()
    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        ocp = _ocp()
        weights = tmp / WEIGHTS_DIR
        group, group_bytes = {}, 0
        want = expected_shapes(config)
        bar = tqdm(total=len(want), desc=f"convert {Path(src).name}", unit="tensor",
                   disable=not progress)
        with bar, warnings.catch_warnings():  # the bar ends its line before any error
            warnings.simplefilter("ignore")  # Orbax's experimental-API notices
            for key, array in _checked_tensors(source, config, DTYPES[dtype], want):
                group[key] = array
                group_bytes += array.nbytes
                bar.update(1)
                if group_bytes >= GROUP_BYTES:
                    ocp.partial.save(weights, group)
                    group, group_bytes = {}, 0
            if group:
                ocp.partial.save(weights, group)
            ocp.partial.finalize(weights)
        (tmp / CONFIG_FILE).write_text(config.to_json())
        for name, data in tokenizer_files.items():
            (tmp / name).write_bytes(data)
        os.rename(tmp, out)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for p in created:  # innermost first
            with contextlib.suppress(OSError):
                p.rmdir()
        if isinstance(e, OSError):
            raise JaxinferError(f"{out}: cannot write checkpoint ({e})") from None
        raise
    return out


def load_model(path: str | Path | HFSource | GGUFSource, dtype: str | None = None,
               sharding: jax.sharding.Sharding | None = None) -> Decoder:
    """Loads a converted dir, an HF dir or a .gguf file (a path, or a source already open).

    Arrays go straight to `sharding` (default: the first device): Orbax restores
    each one into its target sharding, and direct HF/GGUF loads place tensors
    one at a time, so the model is never assembled on the host first.
    `dtype` defaults to the stored dtype (converted) or bfloat16 (HF/GGUF).
    """
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(path, HFSource | GGUFSource):
        source, path = path, path.path
    else:
        path, source = Path(path), None
    if is_converted(path):
        config = ModelConfig.from_json_file(path / CONFIG_FILE)
        weights_dir = path / WEIGHTS_DIR
        ocp = _ocp()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stored = ocp.metadata(weights_dir).metadata
                abstract = {k: jax.ShapeDtypeStruct(m.shape, DTYPES.get(dtype, m.dtype),
                                                    sharding=sharding)
                            for k, m in stored.items()}
                want = expected_shapes(config)
                _check_stored(weights_dir, want, abstract)
                params = ocp.load(weights_dir, abstract)
        except JaxinferError:
            raise
        except Exception as e:
            raise JaxinferError(f"{weights_dir}: cannot read checkpoint ({e})") from None
    else:
        source = source or open_source(path)
        config = source.config
        np_dtype = DTYPES[dtype or "bfloat16"]
        params = {k: jax.device_put(a, sharding)
                  for k, a in _checked_tensors(source, config, np_dtype)}
    param_dtype = next(iter(params.values())).dtype
    model = nnx.eval_shape(lambda: Decoder(config, dtype=param_dtype, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    flat = [(p, v.replace(params[_key(p)])) for p, v in state.flat_state()]
    nnx.update(model, nnx.State.from_flat_path(flat))
    return model


def _check_stored(weights_dir, want, abstract):
    for key, shape in want.items():
        if key not in abstract:
            raise JaxinferError(f"{weights_dir}: checkpoint is missing tensor {key}")
        if tuple(abstract[key].shape) != shape:
            raise JaxinferError(f"{weights_dir}: tensor {key} has shape "
                                f"{tuple(abstract[key].shape)}, the config implies {shape}")
