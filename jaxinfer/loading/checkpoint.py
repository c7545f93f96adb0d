"""Checkpoints: convert HF / GGUF sources to Orbax, and load any of the three into a model.

A converted checkpoint is a directory:
  model_config.json   our ModelConfig (`quantization` says how the projections were quantized)
  weights/            an Orbax checkpoint of a flat dict {key: array}, one key per
                      projection and norm (e.g. "layers.0.attn.q_proj.weight",
                      `jaxinfer.models.inference_form.checkpoint_layout`), weights (out, in)
  tokenizer.json, tokenizer_config.json, ...  copied (HF) or rebuilt (GGUF)

Quantized projections (q/k/v/o, gate/up/down only) are stored as the parts of a
`jaxinfer.ops.quant.QuantizedWeight` under the compressed-tensors / vLLM names:
  layers.3.attn.q_proj.weight         values [N, K] int8, int4 or float8_e4m3fn
  layers.3.attn.q_proj.weight_scale   scales [K // group, N] float32
  layers.3.attn.q_proj.weight_offset  offsets like the scales (asymmetric formats only)
A loader recognises them by their `weight_scale` key; fp8 weights take W8A8
activations when the config's `quantization` format says so ("fp8").

Loading places each tensor on its devices (`jaxinfer.sharding.ParamPlacer`), then builds
the model in the form it runs in, once (`jaxinfer.models.inference_form.inference_model`:
q/k/v and gate/up joined, norm scales folded into float projections).

Conversion streams: tensors are read one at a time and written with Orbax
partial saves in groups of at most GROUP_BYTES, so peak memory tracks the
largest tensor, not the model; only sub-byte values (int4, fp4) are compressed
(`_save_group`). Everything is written to a temporary directory
beside OUT and renamed into place at the end, so a failure leaves nothing behind; the
directory of a killed convert is removed by the next convert into the same OUT.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import dataclasses
import gc
import glob
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.loading.gguf_source import GGUFSource
from jaxinfer.loading.hf_source import HFSource
from jaxinfer.models import Decoder
from jaxinfer.models.inference_form import (
    OFFSET,
    SCALE,
    checkpoint_layout,
    checkpoint_params,
    folded_modules,
    inference_model,
)
from jaxinfer.models.layers import is_quantizable
from jaxinfer.ops.quant import VALUE_DTYPES, QuantFormat, QuantizedWeight, parse_format
from jaxinfer.ops.quant import quantize as quantize_weight
from jaxinfer.sharding import (
    ArrayRecipe,
    MeshSpec,
    ParamPlacer,
    layout_tp,
    logical_to_mesh,
    mesh_axis_size,
    param_axes,
    realize,
    sharded_config,
)

logger = logging.getLogger(__name__)

GROUP_BYTES = 64 << 20
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
CONFIG_FILE, WEIGHTS_DIR = "model_config.json", "weights"
_PARTS = (".weight" + SCALE, ".weight" + OFFSET)
_QUANT_DTYPES = {jnp.dtype(d) for d in VALUE_DTYPES.values()}
_SUB_BYTE_DTYPES = {jnp.dtype(d) for d in (jnp.int4, jnp.uint4, jnp.float4_e2m1fn)}


def _ocp():
    from orbax.checkpoint.experimental import v1 as ocp
    return ocp


def _save_group(ocp, weights: Path, group: dict[str, jax.Array]):
    """One partial save of `group`: sub-byte arrays (int4 / fp4 values, one byte each in
    memory) zstd-compressed, the others as they are. Why not compress everything: a load
    then copies bytes instead of decompressing them (SmolLM2 in float32 on the CPU: 1.1 s
    to 0.55 s, for 515 MB on disk instead of 277: its floats, widened from Q4_1, are what
    zstd packed); on sub-byte values it halves the file, the point of a 4-bit checkpoint."""
    packed = {k: a for k, a in group.items() if jnp.dtype(a.dtype) in _SUB_BYTE_DTYPES}
    for part, compressed in ((packed, True), ({k: a for k, a in group.items()
                                               if k not in packed}, False)):
        if part:
            ctx = ocp.Context()
            ctx.array.saving.use_compression = compressed
            with ctx:
                ocp.partial.save(weights, part)


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
    return {key: t.shape for key, t in checkpoint_layout(config).items()}


def _checked_tensors(source, config: ModelConfig, dtype, want: dict | None = None,
                     fmt: QuantFormat | None = None, native: bool = True):
    """(key, array) pairs, each source tensor checked against the model's shape; all must appear.

    Float tensors are cast to dtype; with `fmt`, the decoder-block projections are
    quantized to it instead. A GGUF's Q4_0 / Q4_1 / Q8_0 projections and an HF
    checkpoint's quantized tensors (NVFP4 / FP8 projections, MXFP4 experts) are kept as they
    are if `native`. A quantized weight is
    yielded as its parts: `key` (values), `key_scale` and, if asymmetric, `key_offset`.
    """
    want = want or expected_shapes(config)
    seen = set()
    tensors = source.tensors(native=native and fmt is None)
    for key, array, file in tensors:
        if key not in want:
            if key == "lm_head" and config.tie_word_embeddings:
                continue  # some tied checkpoints still carry a copy
            raise JaxinferError(f"{file}: tensor {key} is not used by a {config.family} model "
                                "with this config")
        if tuple(array.shape) != want[key]:
            raise JaxinferError(f"{file}: tensor {key} has shape {tuple(array.shape)}, "
                                f"the config implies {want[key]}")
        seen.add(key)
        if fmt is not None and is_quantizable(key):
            try:
                array = quantize_weight(array, fmt)
            except JaxinferError as e:
                raise JaxinferError(f"{file}: tensor {key}: {e}") from None
        if isinstance(array, QuantizedWeight):
            yield key, array.values
            yield key + SCALE, array.scales
            if array.offsets is not None:
                yield key + OFFSET, array.offsets
        else:
            yield key, np.asarray(array).astype(dtype)
    missing = sorted(set(want) - seen)
    if missing:
        raise JaxinferError(f"{source.path}: checkpoint is missing {len(missing)} tensors "
                            f"(first: {missing[0]})")


def _quantize_format(quantize: str | None) -> QuantFormat | None:
    """None / "none" -> None (no requantization); else the parsed format (JaxinferError if bad)."""
    return None if quantize is None or quantize == "none" else parse_format(quantize)


def _check_group_size(source, want: dict, fmt: QuantFormat):
    """Every quantized projection's in_features K must be a multiple of the group size."""
    g = fmt.group_size
    for key, shape in want.items():
        k = shape[-1]
        if is_quantizable(key) and g and k % g:
            raise JaxinferError(f"{source.path}: --quantize {fmt}: tensor {key} has "
                                f"in_features K={k}, not a multiple of the group size {g}")


def _tmp_prefix(out: Path, pid: int) -> str:
    """Name prefix of the temporary directory that process `pid` of this host converts `out`
    in: hidden, beside `out`, and naming its writer, so a later convert can tell whether the
    writer is still running."""
    return f".{out.name}.tmp-{pid}@{socket.gethostname()}-"


def _remove_stale_tmp_dirs(out: Path) -> None:
    """Removes the temporary directories of converts into `out` whose process has died (a
    killed convert cannot remove its own); those of live processes, or of other hosts sharing
    the folder, are left alone."""
    pattern = re.compile(re.escape(f".{out.name}.tmp-") + r"(\d+)@(.+)-[a-z0-9_]+")
    host = socket.gethostname()
    for path in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        m = pattern.fullmatch(path.name)
        if m and m.group(2) == host and not _process_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def convert(src: str | Path, out: str | Path, dtype: str = "bfloat16",
            quantize: str | None = None, progress: bool = True) -> Path:
    """Converts an HF directory or GGUF file to a jaxinfer (Orbax) checkpoint directory.

    `quantize` is a `jaxinfer.ops.quant.parse_format` spelling ("int8", "int4:g128",
    "fp8", ...) for the decoder-block projections, or "none". None (the default):
    HF float weights stay float, a GGUF keeps its Q4_0 / Q4_1 / Q8_0 projections as
    they are (other tensor types are dequantized), and so does an HF checkpoint its
    quantized ones (`jaxinfer.loading.hf_quantized`). "none" dequantizes everything; a
    format dequantizes a source's tensors and quantizes them to it. Everything that
    is not quantized is cast to `dtype`.
    """
    from tqdm import tqdm

    fmt = _quantize_format(quantize)
    if dtype not in DTYPES:
        raise JaxinferError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists():
        raise JaxinferError(f"{out}: already exists (remove it or pick another output)")
    source = open_source(src)
    config = source.config
    want = expected_shapes(config)
    if fmt is not None:
        _check_group_size(source, want, fmt)
    tokenizer_files = source.tokenizer_files()
    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp_dirs(out)
        tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(out, os.getpid()), dir=out.parent))
        ocp = _ocp()
        weights = tmp / WEIGHTS_DIR
        group, group_bytes, native = {}, 0, False
        bar = tqdm(total=len(want), desc=f"convert {Path(src).name}", unit="tensor",
                   disable=not progress)
        with bar, warnings.catch_warnings():  # the bar ends its line before any error
            warnings.simplefilter("ignore")  # Orbax's experimental-API notices
            for key, array in _checked_tensors(source, config, DTYPES[dtype], want, fmt,
                                               native=quantize is None):
                group[key] = array
                group_bytes += array.nbytes
                native |= key.endswith(SCALE)
                if key in want:
                    bar.update(1)
                if group_bytes >= GROUP_BYTES:
                    _save_group(ocp, weights, group)
                    group, group_bytes = {}, 0
            if group:
                _save_group(ocp, weights, group)
            ocp.partial.finalize(weights)
        quantization = (str(fmt) if fmt is not None
                        else source.native_quantization if native else None)
        config = dataclasses.replace(config, quantization=quantization)
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
               mesh: jax.sharding.Mesh | None = None) -> Decoder:
    """Loads a converted dir, an HF dir or a .gguf file (a path, or a source already open).

    Each array goes straight to its devices: on `mesh` (default: the first device alone)
    each device receives only its shard (`jaxinfer.sharding`): Orbax restores every
    array into its target sharding, and direct HF/GGUF loads place tensors one at a
    time, so the model is never assembled on one device or on the host first.
    `dtype` defaults to the stored dtype (converted) or bfloat16 (HF/GGUF); it
    casts float parameters only. Quantized projections (a converted checkpoint's
    `weight_scale` keys, a GGUF's Q4_0 / Q4_1 / Q8_0 tensors) stay quantized.
    """
    mesh = mesh or MeshSpec().meshes()[0]
    if isinstance(path, HFSource | GGUFSource):
        source, path = path, path.path
    else:
        path, source = Path(path), None
    if is_converted(path):
        return ConvertedCheckpoint(path, dtype, mesh).load()
    source = source or open_source(path)
    config = source.config
    placer = model_placer(config, mesh, path)
    np_dtype = DTYPES[dtype or "bfloat16"]
    params = {k: placer.place(k, a) for k, a in _checked_tensors(source, config, np_dtype)}
    if any(k.endswith(SCALE) for k in params):  # a GGUF's or MXFP4 checkpoint's own
        config = dataclasses.replace(config, quantization=source.native_quantization)
    return inference_model(sharded_config(config, placer.tp), params)


class PlacedWeights(abc.ABC):
    """A model's weights for a mesh, described before they exist: `abstract_model()` builds the
    model with an `ArrayRecipe` where each array will be (its form decided by the
    descriptions alone), what a model runner needs to make its programs, so they load or
    compile while the weights are read or made (`load_in_background`, `jaxinfer.llm.LLM`).

    A subclass defines `_read()` (key -> the tensor, placed) and `_build(params)` (the
    model from placed tensors, or from their recipes)."""

    def __init__(self, placer: ParamPlacer, stored: dict[str, jax.ShapeDtypeStruct]):
        """stored: key -> each tensor as the source gives it (placing it gives its form)."""
        self.placer, self._stored = placer, stored
        self._abstract: concurrent.futures.Future = concurrent.futures.Future()

    def abstract_model(self) -> Decoder:
        """The model with an ArrayRecipe for each array (`jaxinfer.sharding.realize`)."""
        def recipe(key, stored):
            placed = self.placer.place(key, stored)
            return ArrayRecipe(placed.shape, placed.dtype, placed.sharding, key=key)

        try:
            model = self._build({k: recipe(k, a) for k, a in self._stored.items()})
        except BaseException as e:
            self._abstract.set_exception(e)  # a background load waits for it
            raise
        self._abstract.set_result(model)
        return model

    def load(self) -> Decoder:
        """Reads (or makes) every tensor onto its devices and builds the model."""
        return self._build(self._read())

    def load_in_background(self) -> concurrent.futures.Future:
        """Starts reading the tensors on a thread, and returns the future of the model:
        `abstract_model()`'s, its recipes realized (so call that: the thread waits for it
        once the tensors are read)."""
        def load() -> Decoder:
            params = self._read()
            graphdef, state = nnx.split(self._abstract.result())
            recipes, treedef = jax.tree.flatten(state)
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, realize(recipes, params)))
            gc.collect()  # the parts a join replaced may sit in reference cycles
            return model

        loader = concurrent.futures.ThreadPoolExecutor(1, "load-weights")
        try:
            return loader.submit(load)
        finally:
            loader.shutdown(wait=False)

    @abc.abstractmethod
    def describe(self) -> dict:
        """What makes these weights again in another process (JSON: `weights_from`)."""

    @abc.abstractmethod
    def _read(self) -> dict[str, jax.Array]:
        """key -> the tensor, placed (`ParamPlacer.place`)."""

    @abc.abstractmethod
    def _build(self, params: dict) -> Decoder:
        """The model of `params` (key -> placed tensor, or its ArrayRecipe)."""


class ConvertedCheckpoint(PlacedWeights):
    """A converted checkpoint opened for loading on `mesh`: its config and stored tensors'
    metadata read and checked (a mismatch raises here), nothing else read yet."""

    def __init__(self, path: Path, dtype: str | None, mesh: jax.sharding.Mesh):
        self.path, self.weights_dir, self.dtype = path, path / WEIGHTS_DIR, dtype
        self.config = ModelConfig.from_json_file(path / CONFIG_FILE)
        placer = model_placer(self.config, mesh, path)
        self.activations = _activations(self.config, path / CONFIG_FILE)
        # One process on CPUs: TensorStore reads the arrays (`HostArrayReader`), else Orbax.
        self._reader = None
        if jax.process_count() == 1 and all(d.platform == "cpu" for d in mesh.devices.flat):
            self._reader = HostArrayReader.open(self.weights_dir)
        if self._reader is not None:
            stored = self._reader.stored
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    # Orbax takes absolute paths.
                    stored = _ocp().metadata(self.weights_dir.absolute()).metadata
            except Exception as e:
                raise JaxinferError(f"{self.weights_dir}: cannot read checkpoint ({e})") \
                    from None
        _check_stored(self.weights_dir, expected_shapes(self.config), stored)
        # As stored, each array restored straight into its placement.
        super().__init__(placer, {
            k: jax.ShapeDtypeStruct(m.shape, _restore_dtype(k, m.dtype, dtype, stored),
                                    sharding=placer.sharding(k, m.shape))
            for k, m in stored.items()})

    def describe(self) -> dict:
        return {"converted": str(self.path.absolute()), "dtype": self.dtype}

    def _read(self) -> dict[str, jax.Array]:
        if self._reader is not None:
            params = self._reader.read(self._stored)
            return {k: self.placer.place(k, a) for k, a in params.items()}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                params = _ocp().load(self.weights_dir.absolute(), self._stored)
        except Exception as e:
            raise JaxinferError(f"{self.weights_dir}: cannot read checkpoint ({e})") from None
        return {k: self.placer.place(k, a) for k, a in params.items()}

    def _build(self, params: dict) -> Decoder:
        return inference_model(sharded_config(self.config, self.placer.tp), params,
                               self.activations)


# XLA's CPU client takes a host array as a device buffer without copying it when the array
# is aligned to this many bytes (malloc's large blocks, numpy's and Orbax's, are 16-aligned).
CPU_ZERO_COPY_ALIGNMENT = 64


class HostArrayReader:
    """The arrays of a converted checkpoint read by TensorStore, the library Orbax stores them
    with, straight into host buffers that XLA's CPU client takes without a copy
    (`CPU_ZERO_COPY_ALIGNMENT`). Orbax stays the writer, and the reader everywhere else.

    Why: the CPU's start-up. Importing Orbax and reading its metadata took 0.25 s of
    `jaxinfer generate`'s first token on the 2-core CPU, and its reads land in 16-aligned
    buffers that placing them copies again: SmolLM2's float32 load (515 MB) took 0.87 s
    that way, 0.3-0.45 s this way. The layout read is Orbax's (the arrays' keys in
    `state/_METADATA`, each a zarr3 array in the OCDBT store `state/`); `open` gives None
    for any other, and tests/test_background_load.py checks the arrays against Orbax's reading.
    """

    def __init__(self, weights_dir: Path, stores: dict):
        self.weights_dir = weights_dir
        self._stores = stores  # key -> tensorstore.TensorStore, opened for reading
        self.stored = {k: jax.ShapeDtypeStruct(tuple(t.shape), t.dtype.numpy_dtype)
                       for k, t in stores.items()}

    @classmethod
    def open(cls, weights_dir: Path) -> HostArrayReader | None:
        """The reader of weights_dir's arrays (all opened), or None if they are not laid out
        as it expects."""
        import tensorstore as ts

        state = (weights_dir / "state").absolute()
        try:
            meta = json.loads((state / "_METADATA").read_text())
            if not (meta.get("use_ocdbt") and meta.get("use_zarr3")):
                return None
            keys = [m["key_metadata"][0]["key"] for m in meta["tree_metadata"].values()]
            context = ts.Context({"file_io_concurrency": {"limit": 128},
                                  "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}})
            kvstore = {"driver": "ocdbt", "cache_pool": "cache_pool#ocdbt",
                       "base": {"driver": "file", "path": state.as_posix() + "/"}}
            opening = {k: ts.open({"driver": "zarr3", "kvstore": {**kvstore, "path": k},
                                   "recheck_cached_data": False,
                                   "recheck_cached_metadata": False},
                                  context=context, open=True, read=True) for k in keys}
            return cls(weights_dir, {k: f.result() for k, f in opening.items()})
        except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
            logger.debug("%s: read through Orbax (%s)", weights_dir, e)
            return None

    def read(self, want: dict[str, jax.ShapeDtypeStruct]) -> dict[str, np.ndarray]:
        """key -> host array of want[key]'s dtype (cast from the stored one if they differ),
        for every key of `want`."""
        import tensorstore as ts

        out, writes = {}, []
        for key, spec in want.items():
            store = self._stores[key]
            if store.dtype.numpy_dtype != np.dtype(spec.dtype):
                store = ts.cast(store, spec.dtype)
            out[key] = _aligned_empty(tuple(store.shape), spec.dtype)
            writes.append(ts.array(out[key], copy=False, write=True).write(store))
        try:
            for w in writes:
                w.result()
        except ValueError as e:  # a damaged or truncated file
            raise JaxinferError(f"{self.weights_dir}: cannot read checkpoint ({e})") from None
        return out


def _aligned_empty(shape, dtype) -> np.ndarray:
    """np.empty(shape, dtype) starting on a CPU_ZERO_COPY_ALIGNMENT boundary."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(size + CPU_ZERO_COPY_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % CPU_ZERO_COPY_ALIGNMENT
    return raw[start:start + size].view(dtype).reshape(shape)


def model_placer(config: ModelConfig, mesh: jax.sharding.Mesh, where="the model"
                 ) -> ParamPlacer:
    """The ParamPlacer of a model of `config` on `mesh` (its split checked first)."""
    MeshSpec(ep=mesh_axis_size(mesh, "ep"), tp=mesh_axis_size(mesh, "tp")).check(config, where)
    axes = {key: t.axes for key, t in checkpoint_layout(config).items()}
    return ParamPlacer(config, mesh, param_axes(axes))


def shard_model(model: Decoder, mesh: jax.sharding.Mesh) -> Decoder:
    """The same model with its parameters placed on `mesh` (a new model; `model` is unchanged,
    and arrays already placed so are shared, not copied):
    one laid out for one device on any mesh, any on a mesh of its own tp (dp replicas).

    A mesh of the model's tp takes each parameter as it is, placed by its logical axes. A
    larger tp takes the model apart into checkpoint tensors (`checkpoint_params`), lays
    them out for it and builds it again, its folded norms as they were (folding rounds)."""
    tp, model_tp = mesh_axis_size(mesh, "tp"), layout_tp(model.embed.embedding[...])
    if model_tp == tp:
        MeshSpec(ep=mesh_axis_size(mesh, "ep"), tp=tp).check(model.config)
        graphdef, state = nnx.split(model)
        return nnx.merge(graphdef, jax.tree.map(
            lambda v: v.replace(jax.device_put(v[...], NamedSharding(
                mesh, logical_to_mesh(v.get_metadata()["axes"], v.shape, mesh)))),
            state, is_leaf=lambda v: isinstance(v, nnx.Variable)))
    if model_tp != 1:
        raise JaxinferError(f"a model laid out for tp={model_tp} cannot move to tp={tp}; "
                            "load it again")
    placer = model_placer(model.config, mesh)
    params = {key: placer.place(key, a) for key, a in checkpoint_params(model).items()}
    activations = next((m.activations for _, m in nnx.iter_graph(model)
                        if getattr(m, "activations", None)), None)
    return inference_model(placer.model_config, params, activations,
                           folded=folded_modules(model))


def _activations(config: ModelConfig, where) -> str | None:
    """The activations of fp8 weights ("fp8": W8A8, or None) from the config's format."""
    if config.quantization in (None, "gguf"):
        return None
    try:
        return parse_format(config.quantization).activations
    except JaxinferError as e:
        raise JaxinferError(f"{where}: quantization={config.quantization!r} is not a known "
                            f"format ({e})") from None


def _restore_dtype(key: str, stored_dtype, dtype: str | None, stored: dict):
    """Quantized parts keep their stored dtype (scales and offsets float32); floats take dtype."""
    if key.endswith(_PARTS):
        return jnp.float32
    if key + SCALE in stored:
        return stored_dtype
    return DTYPES.get(dtype, stored_dtype)


def _check_stored(weights_dir, want: dict, stored: dict):
    """Stored tensors (anything with .shape and .dtype) against the model's shapes.

    A quantized projection `W.weight` [N, K] (int8 / int4 / fp8) comes with
    `W.weight_scale` [G, N], G dividing K, and optionally `W.weight_offset` like it.
    """
    for key, shape in want.items():
        if key not in stored:
            raise JaxinferError(f"{weights_dir}: checkpoint is missing tensor {key}")
        if tuple(stored[key].shape) != shape:
            raise JaxinferError(f"{weights_dir}: tensor {key} has shape "
                                f"{tuple(stored[key].shape)}, the config implies {shape}")
        quantized_values = jnp.dtype(stored[key].dtype) in _QUANT_DTYPES
        if quantized_values != (key + SCALE in stored):
            raise JaxinferError(
                f"{weights_dir}: tensor {key} is {jnp.dtype(stored[key].dtype)} "
                + ("without" if quantized_values else "with")
                + f" a {key}{SCALE} (quantized values are int8, int4, float8_e4m3fn or "
                "float4_e2m1fn)")
    for key, array in stored.items():
        if not key.endswith(_PARTS):
            continue
        weight = key.removesuffix(SCALE).removesuffix(OFFSET)
        if weight not in want or not is_quantizable(weight):
            raise JaxinferError(f"{weights_dir}: tensor {key}: only the decoder-block "
                                "projections (q/k/v/o, gate/up/down, experts) can be quantized")
        if weight + SCALE not in stored:
            raise JaxinferError(f"{weights_dir}: tensor {key} has no {weight}{SCALE}")
        *stack, n, k = want[weight]  # an expert stack [E, N, K] has scales [E, G, N]
        shape = tuple(array.shape)
        if (len(shape) != len(stack) + 2 or list(shape[:-2]) != stack or shape[-1] != n
                or not shape[-2] or k % shape[-2]
                or not jnp.issubdtype(array.dtype, jnp.floating)):
            expected = ", ".join(map(str, [*stack, "G", n]))
            raise JaxinferError(f"{weights_dir}: tensor {key} is {jnp.dtype(array.dtype)} "
                                f"{shape}; expected float [{expected}] with G dividing "
                                f"in_features {k}")
        if key.endswith(OFFSET) and shape != tuple(stored[weight + SCALE].shape):
            raise JaxinferError(f"{weights_dir}: tensor {key} has shape {shape}, its "
                                f"{weight}{SCALE} {tuple(stored[weight + SCALE].shape)}")
