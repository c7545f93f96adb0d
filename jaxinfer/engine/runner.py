"""Model runner: turns a scheduled ragged batch into padded device arrays and
runs one jitted step (model forward + sampling) over the paged KV cache.

Shapes are padded to power-of-two buckets (tokens T, sequences S, pages per
sequence P; a decode batch has T = S): a batch's `StepShape` names its compiled program,
which `jaxinfer.engine.compiled_steps.CompiledSteps` makes once (ahead of time at warm-up,
or loaded from disk) and reuses. The KV cache is donated so XLA updates the pages in place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.engine import multihost
from jaxinfer.engine.compiled_steps import CompiledSteps, StepShape
from jaxinfer.engine.packing import PackedLayout
from jaxinfer.engine.request import MAX_LOGPROBS
from jaxinfer.engine.sampling import (
    SamplingTensors,
    greedy_tokens,
    logprobs_of,
    sample,
    token_counts,
)
from jaxinfer.engine.scheduler import SeqChunk
from jaxinfer.models import Decoder
from jaxinfer.ops.attention import KV_PAGES_AXES, AttentionMetadata
from jaxinfer.ops.kernels import import_platform_kernels
from jaxinfer.ops.registry import batch_invariant_mode, invariant_compiler_options
from jaxinfer.sharding import (
    MeshSpec,
    PeerAllReduce,
    logical_to_mesh,
    peer_all_reduce,
    peer_all_reduce_capacity,
)

# The context the warm-up compiles for by default (`LLM.warmup`), and the narrowest page
# table a batch takes (`ModelRunner.step_shape`): narrower tables were more programs to
# compile, for no speed (bench/NOTES.md, Start-up: compiling the step programs: One program
# per token bucket).
WARMUP_CONTEXT = 2048
# The fewest token rows of a program in batch-invariant mode (`ModelRunner.step_shape`).
INVARIANT_MIN_TOKENS = 8


def bucket(n: int, minimum: int, maximum: int | None = None) -> int:
    """The smallest power of two >= max(n, minimum), capped at maximum."""
    b = max(minimum, 1 << max(n - 1, 0).bit_length())
    return min(b, maximum) if maximum else b


def last_tokens(tokens, num_seqs: int, size: int):
    """tokens [S, N] (-1 after a row finished on the device) -> [size] int32: each row's last
    token, the next step's input where it takes it on the device (`StepInputs.prev_rows`)."""
    kept = min(num_seqs, size)
    taken = jnp.sum(tokens >= 0, axis=1)
    last = jnp.take_along_axis(tokens, jnp.maximum(taken - 1, 0)[:, None], 1)[:, 0]
    return jnp.zeros(size, jnp.int32).at[:kept].set(last[:kept])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    md: AttentionMetadata
    logits_indices: jax.Array  # [S] int32: the token whose logits each sequence samples from
    sampling: SamplingTensors
    history: jax.Array  # [S, L] int32 prompt + output ids, -1 padded (L = 0: no penalties)
    num_prompt: jax.Array  # [S] int32: history[s, :num_prompt[s]] is the prompt
    remaining: jax.Array  # [S] int32: tokens s may still produce (multi-step decode stops there)
    stops_on_eos: jax.Array  # [S] bool: an EOS token ends s (not ignore_eos)
    # [T] int32: -1, or the row of the previous step whose sampled token is this token (it is
    # still on the device when this step is launched: `SeqChunk.prev_row`)
    prev_rows: jax.Array


@dataclasses.dataclass
class StepOutput:
    """tokens [S, N] int32 (-1 after a sequence finished on the device: EOS or its remaining
    budget); with logprobs: logprobs [S, N] f32 and top_ids / top_logprobs [S, N, MAX_LOGPROBS]."""

    tokens: np.ndarray
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


class DecodeLoopState(NamedTuple):
    """The carry of the multi-step decode loop (`ModelRunner._sample`): S sequences (padded),
    T tokens (T = S: one per sequence), N = num_steps, K top logprobs (MAX_LOGPROBS, or 1
    without logprobs), V the vocabulary."""

    i: jax.Array  # int32 scalar: steps run so far
    kv_cache: list  # per pool (k, v) pages [layers * (num_pages + 1), page_size, Hkv, D]
    last: jax.Array  # [S] int32: each sequence's latest token, the next step's input
    done: jax.Array  # [S] bool: finished (EOS, remaining budget, or padding)
    md: AttentionMetadata  # kv_lens grow by one per live step; done rows use the scratch page
    positions: jax.Array  # [T] int32
    steps: jax.Array  # [S] int32: the sampling key's counter (tokens generated so far)
    seen: jax.Array | None  # [S, V] bool: in prompt or output (None: no penalties)
    counts: jax.Array | None  # [S, V] int32: output counts (None: no penalties)
    out_tokens: jax.Array  # [S, N] int32, -1 after a sequence finished
    out_lp: jax.Array  # [S, N] f32: the sampled tokens' logprobs
    out_top_ids: jax.Array  # [S, N, K] int32
    out_top_lp: jax.Array  # [S, N, K] f32


class ModelRunner:
    """Runs batches on the model. The KV cache has num_pages + 1 pages: the last is a scratch
    page that sequences finished in the middle of a multi-step decode write into. It is
    allocated when first used (`kv_cache`): programs compile from its shapes alone
    (`kv_avals`), so a warm-up compiles, and XLA autotunes its GEMMs on fresh copies of
    their operands, before the pool takes the memory that planning left it."""

    def __init__(self, model: Decoder, num_pages: int, page_size: int, max_model_len: int,
                 mesh: jax.sharding.Mesh | None = None, max_num_seqs: int | None = None,
                 kv_dtype=None, weights: concurrent.futures.Future | None = None,
                 batch_invariant: bool = False):
        """`mesh`: the one the model's parameters were placed on (`jaxinfer.sharding`);
        the KV cache is split over its KV heads like the k/v projections. The model runs as
        it comes, built by the loader (`jaxinfer.models.inference_form`). `weights`: a
        future of the model while it loads, `model` then its abstract form (arrays
        described, `ConvertedCheckpoint.abstract_model`): programs are made from the
        descriptions meanwhile, and the first step waits for the weights. `max_num_seqs`:
        the engine's, whose bucket bounds a batch's sequence slots (`step_shape`); None: a
        batch has the bucket of its own sequences. `kv_dtype`: the pages' dtype (default the
        model's; float8_e4m3fn: fp8 pages, written as k and v clipped to e4m3 with scale 1,
        `jaxinfer.ops.attention`). `batch_invariant`: the steps trace in batch-invariant mode
        (`jaxinfer.ops.registry.batch_invariant_mode`)."""
        import_platform_kernels()  # before a program is loaded from disk
        c = model.config
        self.config, self.page_size, self.num_pages = c, page_size, num_pages
        self.mesh = mesh or MeshSpec().meshes()[0]
        self.scratch_page = num_pages
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.min_page_bucket = bucket(-(-min(WARMUP_CONTEXT, max_model_len) // page_size), 1,
                                      self.max_pages_per_seq)
        self.max_seq_slots = None if max_num_seqs is None else bucket(max_num_seqs, 1)
        self.batch_invariant = batch_invariant
        # A conditional costs an accelerator a host round trip in the step (`sample`): the
        # multi-step decode loop draws every step there.
        self._skip_draw = self.mesh.devices.flat[0].platform == "cpu"
        self.graphdef, state = nnx.split(model)
        # Flattening the nnx.State pytree costs ~0.4 ms per call; a list of leaves ~0.06.
        leaves, self.state_treedef = jax.tree.flatten(state)
        # What the programs are made from: the parameters' shapes, dtypes and shardings.
        self.state_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            for x in leaves]
        self._state_leaves = None if weights is not None else leaves
        self._weights = weights
        self.eos_token_ids = tuple(c.eos_token_ids)
        dtype = model.embed.embedding.dtype if kv_dtype is None else jnp.dtype(kv_dtype)
        # One (k, v) pair per pool, each holding `per_pool` layers' num_pages + 1 pages
        # (`Decoder.kv_cache_pools`: a pool a layer, or one a position of a scanned group).
        pools, self.layers_per_pool = model.kv_cache_pools
        shape = (self.layers_per_pool * (num_pages + 1), page_size, c.num_kv_heads,
                 c.head_dim)
        # Committed to its devices like the step's outputs: an uncommitted first cache would
        # make the first call of each bucket compile a second time once the cache comes back.
        kv_sharding = NamedSharding(self.mesh, logical_to_mesh(KV_PAGES_AXES, shape, self.mesh))
        self._kv_zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=kv_sharding)
        aval = jax.ShapeDtypeStruct(shape, dtype, sharding=kv_sharding)
        self.kv_avals = [(aval, aval) for _ in range(pools)]
        self._kv_cache = None
        # Outputs replicated, so every process (multi-host) can read them.
        options = {}
        if batch_invariant:
            options |= invariant_compiler_options(self.mesh.devices.flat[0].platform)
        jit = dict(donate_argnums=(0,), out_shardings=(NamedSharding(self.mesh, P()),
                                                       kv_sharding),
                   compiler_options=options)
        self._sample_step = jax.jit(self._sample, static_argnames=(
            "layout", "num_steps", "with_logprobs", "filtered"), **jit)
        self._layouts: dict[StepShape, PackedLayout] = {}
        # The last sampled token of each row of the latest sample step, which the next step
        # may take as its input tokens (`StepInputs.prev_rows`): it stays on the device.
        self.prev_slots = self.max_seq_slots or 1
        replicated = NamedSharding(self.mesh, P())
        # The peer-memory all-reduce (`jaxinfer.sharding.reduce_over`): its workspace's
        # addresses are a step argument ([n, 2] uint32; [1, 2] where it is off), the
        # buffers (2 MiB a device on 2 GPUs) are allocated on first use.
        self.peer_capacity = peer_all_reduce_capacity(self.mesh)
        self._peers_aval = jax.ShapeDtypeStruct(
            (self.mesh.size if self.peer_capacity else 1, 2), jnp.uint32, sharding=replicated)
        self._peer_workspace = None  # kept alive: steps write it through its addresses
        self._peers = None
        self._prev_aval = jax.ShapeDtypeStruct((self.prev_slots,), jnp.int32,
                                               sharding=replicated)
        self._prev_tokens = None
        self._draw_step = jax.jit(self._draw, static_argnames=("layout", "with_logprobs",
                                                               "filtered"),
                                  out_shardings=replicated, compiler_options=options)
        self._logits_step = jax.jit(self._logits, static_argnames=("layout",), **jit)
        # prev_slots: the size of a draw's last tokens, which no argument of it shows.
        identity = repr((c, self.eos_token_ids, page_size, num_pages, jit["compiler_options"],
                         batch_invariant, self.prev_slots, self.peer_capacity,
                         self.mesh.axis_names, self.mesh.devices.shape,
                         [d.id for d in self.mesh.devices.flat],
                         [(x.shape, x.dtype, x.sharding) for x in self.state_avals],
                         [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(self.kv_avals)]))
        self.steps = CompiledSteps("step", self.lower, self.example_args, self._out_tree,
                                   identity, self.mesh.devices.flat)

    @property
    def state_leaves(self) -> list[jax.Array]:
        """The model's parameters (flattened state), waiting for them if they load."""
        if self._state_leaves is None:
            model = self._weights.result()  # raises the load's error
            leaves, treedef = jax.tree.flatten(nnx.state(model))
            if treedef != self.state_treedef or [
                    (x.shape, x.dtype, x.sharding) for x in leaves] != [
                    (a.shape, a.dtype, a.sharding) for a in self.state_avals]:
                raise RuntimeError("the loaded model differs from the abstract model its "
                                   "programs were made for")
            self._state_leaves = leaves
        return self._state_leaves

    @property
    def kv_cache(self) -> list:
        """Per pool (k, v) pages, allocated (zeros) on first use."""
        self.allocate_kv_cache()
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, pools: list):
        self._kv_cache = pools

    @property
    def peers(self) -> jax.Array:
        """The step argument of the peer-memory all-reduce: its workspace's addresses
        (allocated on first use; zeros where it is off)."""
        if self._peers is None:
            if self.peer_capacity:
                from jaxinfer.mosaic.all_reduce import make_workspace

                self._peer_workspace = make_workspace(self.mesh, self.peer_capacity)
                self._peers = self._peer_workspace.peers
            else:
                self._peers = jax.device_put(np.zeros((1, 2), np.uint32),
                                             self._peers_aval.sharding)
        return self._peers

    def _peer_config(self, peers) -> PeerAllReduce | None:
        return PeerAllReduce(peers, self.peer_capacity) if self.peer_capacity else None

    def allocate_kv_cache(self):
        """Allocates the KV pages (zeros) unless they are (the peer all-reduce's workspace
        first: the pool takes what planning left)."""
        if self._kv_cache is None:
            self.peers  # noqa: B018 (allocates)
            self._kv_cache = [(self._kv_zeros(), self._kv_zeros()) for _ in self.kv_avals]

    def lower(self, shape: StepShape, *args) -> jax.stages.Lowered:
        with jax.set_mesh(self.mesh), batch_invariant_mode(self.batch_invariant):
            layout = self.layout(shape)
            if shape.kind == "draw":
                return self._draw_step.trace(*args, layout=layout,
                                             with_logprobs=shape.with_logprobs,
                                             filtered=shape.filtered).lower()
            kv_cache, state_leaves, words, peers, *prev_tokens = args
            if shape.kind == "logits":
                return self._logits_step.trace(kv_cache, state_leaves, words, peers,
                                               layout=layout).lower()
            return self._sample_step.trace(kv_cache, state_leaves, words, peers, *prev_tokens,
                                           layout=layout, num_steps=shape.num_steps,
                                           with_logprobs=shape.with_logprobs,
                                           filtered=shape.filtered).lower()

    def example_args(self, shape: StepShape) -> tuple:
        # The weights where they are loaded (lowering reads only their shapes, dtypes and
        # shardings), their descriptions while they load.
        weights = self._state_leaves if self._state_leaves is not None else self.state_avals
        inputs = self.empty_inputs(shape)
        words = self.layout(shape).pack(self.packed(shape, inputs))
        if shape.kind == "draw":  # the logits of a sample step, and its sampling inputs
            logits = jax.ShapeDtypeStruct((shape.num_seqs, self.config.vocab_size), jnp.float32,
                                          sharding=self._prev_aval.sharding)
            return logits, words
        if shape.kind == "logits":
            return self.kv_avals, weights, words, self._peers_aval
        return self.kv_avals, weights, words, self._peers_aval, self._prev_aval

    @staticmethod
    def packed(shape: StepShape, inputs: StepInputs):
        """What a program of this shape takes packed: a step all its inputs, a draw the
        sampling inputs of the step whose logits it samples from."""
        if shape.kind == "draw":
            return inputs.sampling, inputs.history, inputs.num_prompt
        return inputs

    def layout(self, shape: StepShape) -> PackedLayout:
        """How a batch of this shape's inputs are packed (`PackedLayout`)."""
        # What the inputs' arrays follow: the kind of program (a step or a draw) and buckets.
        key = dataclasses.replace(shape, kind="draw" if shape.kind == "draw" else "sample",
                                  num_steps=1, with_logprobs=False, filtered=False)
        if (layout := self._layouts.get(key)) is None:
            layout = self._layouts[key] = PackedLayout.of(
                self.packed(shape, self.empty_inputs(shape)))
        return layout

    def _out_tree(self, shape: StepShape):
        if shape.kind == "draw":
            return jax.tree.structure((0, 0, 0, 0, 0))
        kv = [tuple(0 for _ in layer) for layer in self.kv_avals]
        if shape.kind == "logits":
            return jax.tree.structure((0, kv))
        # One step also returns its logits, for the draw (`_run`).
        return jax.tree.structure(((0,) * (6 if shape.num_steps == 1 else 5), kv))

    def _model(self, state_leaves) -> Decoder:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.state_treedef, state_leaves))

    def _logits(self, kv_cache, state_leaves, words, peers, *, layout: PackedLayout):
        inputs: StepInputs = layout.unpack(words)
        model = self._model(state_leaves)
        with peer_all_reduce(self._peer_config(peers)):
            hidden, kv_cache = model(inputs.token_ids, inputs.positions, kv_cache, inputs.md)
            return model.logits(hidden), kv_cache

    def _sample(self, kv_cache, state_leaves, words, peers, prev_tokens, *,
                layout: PackedLayout, num_steps: int, with_logprobs: bool,
                filtered: bool = False):
        """`_sample_body`, its model's sums over the mesh with the peer-memory all-reduce
        where it is on (peers: its workspace's addresses, `peers`)."""
        with peer_all_reduce(self._peer_config(peers)):
            return self._sample_body(kv_cache, state_leaves, words, prev_tokens,
                                     layout=layout, num_steps=num_steps,
                                     with_logprobs=with_logprobs, filtered=filtered)

    def _sample_body(self, kv_cache, state_leaves, words, prev_tokens, *,
                     layout: PackedLayout, num_steps: int, with_logprobs: bool,
                     filtered: bool = False):
        """One forward + sample, or num_steps of them for a decode-only batch (one token per
        sequence) in a while loop that exits once every sequence has finished. prev_tokens
        [prev_slots] int32: the previous sample step's last token per row, taken where
        inputs.prev_rows says. Returns ((tokens [S, N], logprobs [S, N], top ids and
        logprobs [S, N, K], each row's last token [prev_slots]), the KV cache); one step
        (N = 1) takes the greedy tokens and also returns its logits [S, V] f32, which
        `_draw` samples from when a row of the batch samples (`_run`). words: the
        batch's `StepInputs`, packed (`PackedLayout`). filtered (the multi-step loop's draw):
        some sampled row sets top_k, top_p or min_p (`SamplingTensors.filters`); without,
        its draw skips the vocabulary sort, which a greedy batch's draw (on GPUs, where the
        loop draws every step) then never pays."""
        inputs: StepInputs = layout.unpack(words)
        model = self._model(state_leaves)
        vocab, S = self.config.vocab_size, inputs.logits_indices.shape[0]
        from_prev = inputs.prev_rows >= 0
        inputs = dataclasses.replace(inputs, token_ids=jnp.where(
            from_prev, prev_tokens[jnp.where(from_prev, inputs.prev_rows, 0)], inputs.token_ids))

        penalties = inputs.history.shape[1] > 0
        seen, counts = (token_counts(inputs.history, inputs.num_prompt, vocab) if penalties
                        else (None, None))
        num_top = MAX_LOGPROBS if with_logprobs else 1
        rows = jnp.arange(S)

        def forward(kv_cache, token_ids, positions, md, steps, seen, counts, draw=True):
            hidden, kv_cache = model(token_ids, positions, kv_cache, md)
            logits = model.logits(hidden[inputs.logits_indices])
            t = dataclasses.replace(inputs.sampling, steps=steps)
            tokens = (sample(logits, t, seen, counts, skip_draw=self._skip_draw,
                             filtered=filtered) if draw
                      else greedy_tokens(logits, t, seen, counts))
            if with_logprobs:
                lp = logprobs_of(logits, tokens, num_top)
            else:
                lp = (jnp.zeros(S), jnp.zeros((S, 1), jnp.int32), jnp.zeros((S, 1)))
            return tokens, lp, kv_cache, logits

        if num_steps == 1:
            # The greedy tokens: a batch that samples runs the draw after this program
            # (`_run`), so a greedy one never pays the vocabulary sort.
            tokens, lp, kv_cache, logits = forward(
                kv_cache, inputs.token_ids, inputs.positions, inputs.md, inputs.sampling.steps,
                seen, counts, draw=False)
            return ((tokens[:, None], lp[0][:, None], lp[1][:, None], lp[2][:, None],
                     last_tokens(tokens[:, None], S, self.prev_slots), logits), kv_cache)

        # A decode-only batch (token s is sequence s's): all num_steps steps run in one while
        # loop (the first is not peeled off ahead of it), so the program holds one copy of
        # the model.
        md = inputs.md
        live = rows < inputs.md.num_seqs[0]
        eos = jnp.asarray(self.eos_token_ids or (-2,), jnp.int32)

        def finished(tokens, produced):
            is_eos = jnp.any(tokens[:, None] == eos[None, :], axis=-1) & inputs.stops_on_eos
            return is_eos | (produced >= inputs.remaining) | ~live

        out_tokens = jnp.full((S, num_steps), -1, jnp.int32)
        out_lp = jnp.zeros((S, num_steps))
        out_top_ids = jnp.zeros((S, num_steps, num_top), jnp.int32)
        out_top_lp = jnp.zeros((S, num_steps, num_top))
        state = DecodeLoopState(
            i=0, kv_cache=kv_cache, last=inputs.token_ids[:S], done=~live, md=md,
            positions=inputs.positions, steps=inputs.sampling.steps, seen=seen, counts=counts,
            out_tokens=out_tokens, out_lp=out_lp, out_top_ids=out_top_ids,
            out_top_lp=out_top_lp)

        def cond(state: DecodeLoopState):
            return (state.i < num_steps) & ~jnp.all(state.done)

        def body(state: DecodeLoopState) -> DecodeLoopState:
            """Step i: the batch's own tokens at i = 0, then each sequence's last sample."""
            i, done, seen, counts = state.i, state.done, state.seen, state.counts
            later = i > 0
            if penalties:
                seen = seen.at[rows, state.last].set(seen[rows, state.last] | later)
                counts = counts.at[rows, state.last].add(later.astype(counts.dtype))
            # Finished sequences stop advancing and write into the scratch page.
            step = (~done & later).astype(jnp.int32)
            md = dataclasses.replace(
                state.md, kv_lens=state.md.kv_lens + step,
                page_indices=jnp.where(done[:, None], self.scratch_page, state.md.page_indices))
            positions = state.positions.at[:S].add(step)
            token_ids = inputs.token_ids.at[:S].set(state.last)
            tokens, lp, kv_cache, _ = forward(state.kv_cache, token_ids, positions, md,
                                              state.steps, seen, counts)
            tokens = jnp.where(done, -1, tokens)
            out_tokens = state.out_tokens.at[:, i].set(tokens)
            out_lp = state.out_lp.at[:, i].set(lp[0])
            out_top_ids = state.out_top_ids.at[:, i].set(lp[1])
            out_top_lp = state.out_top_lp.at[:, i].set(lp[2])
            done = done | finished(tokens, i + 1)
            return DecodeLoopState(
                i=i + 1, kv_cache=kv_cache, last=jnp.where(done, state.last, tokens), done=done,
                md=md, positions=positions, steps=state.steps + 1, seen=seen, counts=counts,
                out_tokens=out_tokens, out_lp=out_lp, out_top_ids=out_top_ids,
                out_top_lp=out_top_lp)

        state = jax.lax.while_loop(cond, body, state)
        return ((state.out_tokens, state.out_lp, state.out_top_ids, state.out_top_lp,
                 last_tokens(state.out_tokens, S, self.prev_slots)), state.kv_cache)

    def _draw(self, logits, words, *, layout: PackedLayout, with_logprobs: bool,
              filtered: bool):
        """The draw of a one-step batch that samples (`sample`), from the step's logits
        [S, V] f32: its tokens, logprobs and last tokens as the step returns them. words:
        the batch's sampling tensors, token history and prompt lengths, packed (`packed`).
        filtered: some row sets top_k, top_p or min_p (`SamplingTensors.filters`)."""
        sampling, history, num_prompt = layout.unpack(words)
        S, vocab = logits.shape
        seen, counts = ((None, None) if history.shape[1] == 0
                        else token_counts(history, num_prompt, vocab))
        tokens = sample(logits, sampling, seen, counts, skip_draw=False, filtered=filtered)
        if with_logprobs:
            lp = logprobs_of(logits, tokens, MAX_LOGPROBS)
        else:
            lp = (jnp.zeros(S), jnp.zeros((S, 1), jnp.int32), jnp.zeros((S, 1)))
        return (tokens[:, None], lp[0][:, None], lp[1][:, None], lp[2][:, None],
                last_tokens(tokens[:, None], S, self.prev_slots))

    def step_shape(self, chunks: list[SeqChunk], num_steps: int = 1,
                   with_logprobs: bool = False, kind: str = "sample") -> StepShape:
        """The buckets a batch pads to, i.e. the program it runs.

        num_steps > 1 (a multi-step decode: one new token per chunk, token s is sequence
        s's) sizes the page table for the min(num_steps, remaining) tokens each will write.
        """
        num_tokens = sum(len(c.new_tokens) for c in chunks)
        # One program per token bucket: a batch's tokens pad to a power of two T, its
        # sequence slots to min(T, max_num_seqs' bucket) (every sequence has a token, so a
        # batch never has more sequences than T: a decode batch takes S = T, one row per
        # sequence), its page table to at least WARMUP_CONTEXT tokens. The implementations'
        # work follows the live tokens and their context, not the padding, so prompts,
        # decodes and their mixes of one token count share a program, all in the warm-up.
        if self.batch_invariant:
            # Every program at least INVARIANT_MIN_TOKENS token rows and all the sequence
            # slots: XLA:CPU reduces a row (a norm's mean, a softmax's sum) in one order
            # below 8 rows and in another from 8 on, so a token's numbers would change
            # with the number of rows beside it.
            T = bucket(num_tokens, INVARIANT_MIN_TOKENS)
            S = self.max_seq_slots or bucket(len(chunks), 1)
        else:
            T = bucket(num_tokens, 1)
            S = min(T, self.max_seq_slots or bucket(len(chunks), 1))
        if num_steps > 1:
            assert num_tokens == len(chunks), "a multi-step decode has one token a sequence"
        max_pages = max(-(-(c.num_cached + max(len(c.new_tokens), min(num_steps, c.remaining)))
                          // self.page_size) for c in chunks)
        P = bucket(max_pages, self.min_page_bucket, self.max_pages_per_seq)
        penalized = any(c.history is not None for c in chunks)  # (only penalties need it)
        L = bucket(max(len(c.history or ()) for c in chunks), 16) if penalized else 0
        return StepShape(kind, T, S, P, L, num_steps, with_logprobs)

    def warmup_shapes(self, max_num_seqs: int, max_num_batched_tokens: int,
                      decode_steps: int, max_len: int) -> list[StepShape]:
        """The programs a server compiles before it is ready: a batch of each token bucket
        up to max_num_batched_tokens, at each page bucket up to max_len tokens of context,
        and (decode_steps > 1) the multi-step decode batches of each sequence bucket (with
        and without the filters in their draw), and
        the draw of each one-step batch's sequence slots. Built with `step_shape`, so they
        are the shapes those batches will ask for. Batches with
        logprobs or penalties compile on first use; a batch's next page bucket compiles in
        the background (`launch`)."""
        ps = self.page_size
        page_buckets = sorted({bucket(n, self.min_page_bucket, self.max_pages_per_seq)
                               for n in range(1, -(-max_len // ps) + 1)})
        token_buckets = sorted({bucket(n, 1) for n in range(1, max_num_batched_tokens + 1)})
        shapes = set()
        for p in page_buckets:
            for t in token_buckets:  # t tokens over min(t, max_num_seqs) sequences
                s = min(t, max_num_seqs)
                chunks = []
                for i in range(s):
                    q_len = t // s + (i < t % s)
                    chunks.append(SeqChunk(new_tokens=[0] * q_len,
                                           num_cached=max(p * ps - q_len, 0), pages=[]))
                shapes.add(self.step_shape(chunks))
            if decode_steps > 1:
                for t in token_buckets:
                    if t <= bucket(max_num_seqs, 1):
                        context = max(p * ps - decode_steps, 0)
                        chunks = [SeqChunk(new_tokens=[0], num_cached=context, pages=[],
                                           remaining=decode_steps)] * t
                        multi = self.step_shape(chunks, decode_steps)
                        # its loop's draw without the filters, and with
                        shapes |= {multi, dataclasses.replace(multi, filtered=True)}
        # The draws of each one-step batch's sequence slots, for batches that sample
        # (`_run`): from the whole distribution, and with the filters.
        shapes |= {StepShape("draw", s.num_seqs, s.num_seqs, 0, filtered=filtered)
                   for s in list(shapes) if s.kind == "sample" and s.num_steps == 1
                   for filtered in (False, True)}
        return sorted(shapes)

    def empty_inputs(self, shape: StepShape) -> StepInputs:
        """Host-side inputs of a shape holding no sequence (greedy; pages: the scratch
        page)."""
        T, S, P, L = shape.num_tokens, shape.num_seqs, shape.pages_per_seq, shape.history
        md = AttentionMetadata(cu_q_lens=np.zeros(S + 1, np.int32),
                               kv_lens=np.zeros(S, np.int32),
                               page_indices=np.full((S, P), self.scratch_page, np.int32),
                               num_seqs=np.zeros(1, np.int32), scratch_page=True,
                               zero_tails=False)  # the pools hold finite values only
        return StepInputs(np.zeros(T, np.int32), np.zeros(T, np.int32), md,
                          np.zeros(S, np.int32), SamplingTensors.build([], [], [], S),
                          np.full((S, L), -1, np.int32), np.zeros(S, np.int32),
                          np.zeros(S, np.int32), np.zeros(S, bool), np.full(T, -1, np.int32))

    def prepare(self, chunks: list[SeqChunk], shape: StepShape) -> StepInputs:
        """Host-side: the batch padded to its shape's buckets (numpy; `_run` packs them for
        one transfer). Whole-array operations over per-chunk lists: the host prepares a step
        while the device runs the one before, and numpy item writes chunk by chunk took
        1.3 ms at 256 decodes (CPU) against 0.7."""
        x = self.empty_inputs(shape)
        md, n, P = x.md, len(chunks), shape.pages_per_seq
        # One pass over the chunks for their numbers: [n, 6] int32 columns.
        # (np.fromiter over flat values: a list of tuples converts at twice the cost)
        q_lens, cached, prev, num_pages, remaining, stops_on_eos = np.fromiter(
            itertools.chain.from_iterable(
                (len(c.new_tokens), c.num_cached, c.prev_row, min(len(c.pages), P), c.remaining,
                 c.params is None or not c.params.ignore_eos) for c in chunks),
            np.int32, 6 * n).reshape(n, 6).T
        ends = np.cumsum(q_lens, dtype=np.int32)
        T = int(ends[-1]) if n else 0
        starts = ends - q_lens
        x.token_ids[:T] = np.fromiter(
            itertools.chain.from_iterable(c.new_tokens for c in chunks), np.int32, T)
        # Token t of chunk s is at position cached[s] + (t - starts[s]).
        x.positions[:T] = np.arange(T, dtype=np.int32) + np.repeat(cached - starts, q_lens)
        taken = prev >= 0  # its first token is still on the device
        x.token_ids[starts[taken]] = 0
        x.prev_rows[starts[taken]] = prev[taken]
        md.cu_q_lens[1:n + 1] = ends
        md.cu_q_lens[n + 1:] = T
        md.kv_lens[:n] = cached + q_lens
        md.num_seqs[0] = n
        # Row s's first num_pages[s] entries, in row order: the chunks' page lists laid end
        # to end.
        md.page_indices[:n][np.arange(P) < num_pages[:, None]] = np.fromiter(
            itertools.chain.from_iterable(c.pages[:P] for c in chunks), np.int32,
            int(num_pages.sum()))
        x.logits_indices[:n] = ends - 1
        x.remaining[:n] = remaining
        x.stops_on_eos[:n] = stops_on_eos
        if shape.history:
            for s, c in enumerate(chunks):
                if c.history is not None:
                    x.history[s, :len(c.history)] = c.history
                    x.num_prompt[s] = c.num_prompt
        sampling = SamplingTensors.build([c.params for c in chunks], [c.seed for c in chunks],
                                         [c.step for c in chunks], shape.num_seqs)
        return dataclasses.replace(x, sampling=sampling)

    @staticmethod
    def shape_of(inputs: StepInputs, kind: str = "sample", num_steps: int = 1,
                 with_logprobs: bool = False) -> StepShape:
        """The shape of prepared inputs (a follower process receives inputs, not chunks). A
        multi-step decode is `filtered` where a sampled row sets a filter (its loop draws)."""
        filtered = kind == "sample" and num_steps > 1 and inputs.sampling.filters()
        return StepShape(kind, inputs.token_ids.shape[0], inputs.logits_indices.shape[0],
                         inputs.md.page_indices.shape[1], inputs.history.shape[1], num_steps,
                         with_logprobs, filtered)

    def step(self, chunks: list[SeqChunk], num_steps: int = 1,
             with_logprobs: bool = False) -> StepOutput:
        """Runs the batch; returns the tokens sampled for each chunk (from its last token's
        logits, then num_steps - 1 more decode steps when num_steps > 1)."""
        return self.collect(self.launch(chunks, num_steps, with_logprobs))

    def launch(self, chunks: list[SeqChunk], num_steps: int = 1,
               with_logprobs: bool = False) -> PendingStep:
        """Dispatches the batch and returns at once (the device works while the host goes on,
        e.g. launching other replicas' batches); `collect` waits for the result."""
        shape = self.step_shape(chunks, num_steps, with_logprobs)
        inputs = self.prepare(chunks, shape)
        multihost.lead(multihost.SAMPLE, inputs, num_steps, with_logprobs)
        self._prefetch_next_pages(chunks, shape)
        return PendingStep(self._run(inputs, "sample", num_steps, with_logprobs), len(chunks),
                           with_logprobs)

    def run_empty(self, shape: StepShape):
        """Runs shape's program on a batch of no sequence (warm-up of a multi-host job,
        whose followers compile a program when they first run it). Writes nothing: padding
        rows write the scratch page. A draw (`_run`) compiles when a batch first samples."""
        if shape.kind == "draw":
            return
        inputs = self.empty_inputs(shape)
        multihost.lead(multihost.SAMPLE if shape.kind == "sample" else multihost.LOGITS,
                       inputs, shape.num_steps, shape.with_logprobs)
        jax.block_until_ready(self._run(inputs, shape.kind, shape.num_steps,
                                        shape.with_logprobs))

    def _prefetch_next_pages(self, chunks: list[SeqChunk], shape: StepShape):
        """Once a batch's longest sequence is past half of its page bucket, compiles the
        program of the next bucket in the background, so that growing into it (decoding, or
        the next chunk of a long prompt) does not stall the stream (on one process: a
        multi-host job's followers could not follow)."""
        P = shape.pages_per_seq
        if P >= self.max_pages_per_seq or multihost.is_multiprocess():
            return
        if 2 * max(c.num_cached + len(c.new_tokens) for c in chunks) > P * self.page_size:
            self.steps.prefetch(dataclasses.replace(
                shape, pages_per_seq=bucket(P + 1, 1, self.max_pages_per_seq)))

    def _run(self, inputs: StepInputs, kind: str, num_steps: int = 1,
             with_logprobs: bool = False):
        shape = self.shape_of(inputs, kind, num_steps, with_logprobs)
        with jax.set_mesh(self.mesh):
            if self._state_leaves is None:  # the weights still load: the program meanwhile
                self.steps.prefetch(shape)
            # Arguments in this order: the KV pages (allocated on first use), then the
            # weights (waited for), then the program (waited for, or compiled) runs.
            args = [self.kv_cache, self.state_leaves, multihost.to_global(
                self.layout(shape).pack(self.packed(shape, inputs)), self.mesh), self.peers]
            if kind == "sample":
                if self._prev_tokens is None:
                    self._prev_tokens = jax.device_put(np.zeros(self.prev_slots, np.int32),
                                                       self._prev_aval.sharding)
                args.append(self._prev_tokens)
            try:
                out, self.kv_cache = self.steps.run(shape, *args)
            except BaseException:
                # A program that failed on some devices only would leave the peer
                # all-reduce's call counters apart: the next step gets a fresh workspace.
                self._peer_workspace = self._peers = None
                raise
            if kind == "sample" and num_steps == 1:
                logits, out = out[5], out[:5]
                if np.any(inputs.sampling.temperature > 0):  # the host knows: no conditional
                    s = inputs.sampling.temperature.shape[0]
                    draw = StepShape("draw", s, s, 0, shape.history, 1, with_logprobs,
                                     inputs.sampling.filters())
                    words = self.layout(draw).pack(self.packed(draw, inputs))
                    out = self.steps.run(draw, logits, multihost.to_global(words, self.mesh))
            if kind == "sample":
                self._prev_tokens = out[4]
        return out

    @staticmethod
    def collect(pending: PendingStep) -> StepOutput:
        n = pending.num_seqs
        # Only the ids come back to the host unless logprobs were asked for.
        out = pending.out[:4] if pending.with_logprobs else pending.out[:1]
        return StepOutput(*(multihost.host_value(x)[:n] for x in out))

    def logits(self, chunks: list[SeqChunk]) -> list[np.ndarray]:
        """Runs the batch; returns each chunk's float32 logits [len(new_tokens), vocab]."""
        inputs = self.prepare(chunks, self.step_shape(chunks, kind="logits"))
        multihost.lead(multihost.LOGITS, inputs)
        logits = multihost.host_value(self._run(inputs, "logits"))
        out, t = [], 0
        for c in chunks:
            out.append(logits[t:t + len(c.new_tokens)])
            t += len(c.new_tokens)
        return out

    def follow(self) -> list[np.ndarray]:
        """On a process other than 0 (multi-host): runs every step process 0 broadcasts,
        until it broadcasts the end; returns each sampling step's tokens [S, N]."""
        chunks = [SeqChunk(new_tokens=[0], num_cached=0, pages=[0])]
        template = self.prepare(chunks, self.step_shape(chunks))
        tokens = []
        while (received := multihost.follow(template)) is not None:
            kind, inputs, num_steps, with_logprobs = received
            if kind == multihost.SAMPLE:
                out = self._run(inputs, "sample", num_steps, with_logprobs)
                tokens.append(multihost.host_value(out[0]))
            else:
                self._run(inputs, "logits")
        return tokens


@dataclasses.dataclass
class PendingStep:
    """A dispatched batch: the step's device outputs, and how many of its rows are live."""

    out: tuple
    num_seqs: int
    with_logprobs: bool
