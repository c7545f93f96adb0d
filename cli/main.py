"""`jaxinfer generate | chat | convert | serve | bench | plan`: thin click commands over the
library.

Every user-facing failure is a JaxinferError or an option value click rejects, printed as
one line (`Error: ...`) with exit status 1 (2 for a rejected option); no traceback reaches
the user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
import time

import click

from jaxinfer.cli.bench import bench as _bench_group
from jaxinfer.cli.chat import COMMANDS, ChatHistory, read_lines, run_chat
from jaxinfer.cli.parallel import (
    batch_invariant_option,
    join_job,
    kv_cache_dtype_option,
    memory_utilization_option,
    parallel_options,
    scan_layers_option,
)
from jaxinfer.cli.plan import plan as _plan_command
from jaxinfer.cli.serve import serve as _serve_command
from jaxinfer.engine.defaults import describe
from jaxinfer.engine.request import MAX_LOGPROBS, Request, SamplingParams, TokenLogprob
from jaxinfer.errors import JaxinferError
from jaxinfer.llm import LLM
from jaxinfer.loading.checkpoint import convert as convert_checkpoint
from jaxinfer.loading.tokenizer import Tokenizer


def _user_errors(fn):
    """Turns JaxinferError (and Ctrl-C) into a one-line message and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JaxinferError as e:
            raise click.ClickException(" ".join(str(e).split("\n"))) from None
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)

    return wrapper


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return _user_errors(super().invoke)(ctx)
        except click.UsageError as e:
            e.ctx = None  # shown without the usage text and --help hint: one line
            raise


@click.group(cls=_Group)
@click.version_option(package_name="jaxinfer")
def cli():
    """jaxinfer: LLM inference in JAX/Pallas."""


def _packed(decorators, name: str, pack):
    """A decorator adding the options of `decorators` (click.option and the like) to a
    command, which receives their values as one keyword argument `name` = pack(**values)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            values = {key: kwargs.pop(key) for key in keys}
            return fn(*args, **{name: pack(**values)}, **kwargs)

        before = len(getattr(wrapper, "__click_params__", []))
        for decorator in reversed(decorators):
            decorator(wrapper)
        keys = [param.name for param in wrapper.__click_params__[before:]]
        return wrapper

    return decorate


@dataclasses.dataclass
class ModelChoice:
    """The model and engine that --model and the memory / engine / mesh options ask for."""

    path: str | None
    dtype: str | None
    max_model_len: int | None
    kv_cache_gb: float | None
    kv_cache_dtype: str
    batch_invariant: bool
    gpu_memory_utilization: float
    page_size: int
    decode_steps: int | None
    scan_layers: bool | None
    mesh: str | None
    coordinator: str | None
    num_processes: int | None
    process_id: int | None

    def join(self) -> bool:
        """Joins the multi-process job if one is given; True on process 0 (or alone)."""
        return join_job(self.coordinator, self.num_processes, self.process_id)

    def load(self) -> LLM:
        """The LLM of one request at a time (generate, chat): one sequence slot, and a KV
        cache sized for it unless --kv-cache-gb says otherwise."""
        kv_bytes = None if self.kv_cache_gb is None else int(self.kv_cache_gb * 2**30)
        return LLM(self.path, dtype=self.dtype, kv_cache_bytes=kv_bytes,
                   max_model_len=self.max_model_len, page_size=self.page_size,
                   max_num_seqs=1, decode_steps=self.decode_steps, mesh=self.mesh,
                   scan_layers=self.scan_layers, kv_cache_dtype=self.kv_cache_dtype,
                   batch_invariant=self.batch_invariant,
                   gpu_memory_utilization=self.gpu_memory_utilization)


# The memory / engine options keep `jaxinfer serve`'s names and help texts.
model_options = _packed([
    click.option("--model", "path", default=None,
                 help="Converted dir, HF dir or .gguf file (default: embedded "
                      "SmolLM2-135M-Instruct)."),
    click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default=None,
                 help="Compute dtype (default: as stored; bfloat16 for HF/GGUF sources)."),
    click.option("--max-model-len", default=None, type=click.IntRange(min=2),
                 help="Longest prompt + output (default: the model's context, capped by the "
                      "cache)."),
    click.option("--kv-cache-gb", default=None, type=click.FloatRange(min=0, min_open=True),
                 help="Size of the paged KV cache in GiB (default: on a GPU or TPU what "
                      "--gpu-memory-utilization leaves after the weights and a step's reserve; "
                      "on the CPU what one sequence of --max-model-len needs, at most 1)."),
    kv_cache_dtype_option,
    batch_invariant_option,
    memory_utilization_option,
    click.option("--page-size", default=16, show_default=True, type=click.IntRange(min=1),
                 help="Tokens per KV-cache page (prefix caching shares whole pages)."),
    click.option("--decode-steps", default=None, type=click.IntRange(min=1),
                 help="Decode steps per engine step (more: fewer host round trips; "
                      f"{describe('decode_steps')})."),
    scan_layers_option,
    parallel_options,
], "model", ModelChoice)


def _sampling_params(max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
                     presence_penalty, frequency_penalty, seed, stop, logprobs):
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          max_tokens=max_new_tokens, seed=seed, stop=list(stop),
                          repetition_penalty=repetition_penalty,
                          presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, logprobs=logprobs)


def sampling_options(default_max_new_tokens: int):
    """The sampling options, received as `params: SamplingParams`."""
    return _packed([
        click.option("--max-new-tokens", default=default_max_new_tokens, show_default=True,
                     type=click.IntRange(min=1),
                     help="Most tokens to generate (fewer at EOS, a stop, or the context limit)."),
        click.option("--temperature", default=0.0, show_default=True,
                     type=click.FloatRange(min=0), help="0 is greedy."),
        click.option("--top-p", default=1.0, show_default=True,
                     type=click.FloatRange(0, 1, min_open=True)),
        click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=-1),
                     help="0 or -1 disables."),
        click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1),
                     help="Drop tokens less likely than min_p x the most likely; 0 disables."),
        click.option("--repetition-penalty", default=1.0, show_default=True,
                     type=click.FloatRange(min=0, min_open=True),
                     help="> 1 discourages tokens of the prompt and output so far; 1 is off."),
        click.option("--presence-penalty", default=0.0, show_default=True,
                     type=click.FloatRange(-2, 2),
                     help="Subtracted from the logit of every token already in the output."),
        click.option("--frequency-penalty", default=0.0, show_default=True,
                     type=click.FloatRange(-2, 2),
                     help="Subtracted once per occurrence of a token in the output."),
        click.option("--seed", default=0, show_default=True, type=int),
        click.option("--stop", multiple=True, metavar="TEXT",
                     help="Stop before this text (repeatable; in bash $'\\n' is a newline)."),
        click.option("--logprobs", default=None, type=click.IntRange(0, MAX_LOGPROBS),
                     metavar="N",
                     help="After the text, each token's logprob and the N most likely "
                          f"tokens at its place (0 to {MAX_LOGPROBS}; 0: its logprob only)."),
    ], "params", _sampling_params)


def _need_tokenizer(llm: LLM):
    if llm.tokenizer is None:
        raise JaxinferError(f"{llm.path}: the checkpoint has no tokenizer")


def _read_prompt(prompt: str | None) -> str:
    """--prompt's text; stdin's for `--prompt -`, or for no --prompt when stdin is not a
    terminal (one trailing newline dropped)."""
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and sys.stdin.isatty():
        raise JaxinferError("no prompt: give --prompt TEXT, or pipe it in (--prompt - reads "
                            "stdin)")
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise JaxinferError("the prompt read from stdin is empty")
    return text


@dataclasses.dataclass
class _Reply:
    """One streamed request: its text as printed, and when its tokens came."""

    request: Request
    text: str
    ttft: float | None  # seconds from the request to its first token (None: no token)
    decode_seconds: float  # from the first token to the last
    interrupted: bool = False  # by Ctrl-C


def _stream_reply(llm: LLM, ids: list[int], params: SamplingParams, before: str = "",
                  stop_on_interrupt: bool = False) -> _Reply:
    """Streams one request's text to stdout (after `before`, once the prompt is accepted);
    with stop_on_interrupt, Ctrl-C ends the reply rather than the command."""
    start = time.perf_counter()
    request, deltas = llm.stream_request(ids, params)  # raises here if the prompt does not fit
    click.echo(before, nl=False)
    first = last = None
    printed = []
    interrupted = False
    with contextlib.closing(deltas):  # on Ctrl-C too: closing aborts the request
        try:
            for delta in deltas:
                last = time.perf_counter()
                first = first or last
                printed.append(delta.text)
                click.echo(delta.text, nl=False)
        except KeyboardInterrupt:
            if not stop_on_interrupt:
                raise
            interrupted = True
    ttft = None if first is None else first - start
    return _Reply(request, "".join(printed), ttft, 0.0 if first is None else last - first,
                  interrupted)


def _timing_line(reply: _Reply) -> str:
    """llama.cpp-style: prompt tokens / time to first token, output tokens after the first /
    the time after the first."""
    num_prompt, num_output = len(reply.request.prompt_ids), reply.request.num_output
    if reply.ttft is None:
        return f"prompt: {num_prompt} tokens | generated: 0 tokens"
    rate = (f"{(num_output - 1) / reply.decode_seconds:.1f} tokens/s"
            if num_output > 1 and reply.decode_seconds > 0 else "- tokens/s")
    return (f"prompt: {num_prompt} tokens, {num_prompt / reply.ttft:.1f} tokens/s | "
            f"generated: {num_output} tokens, {rate} | TTFT: {reply.ttft * 1e3:.1f} ms")


def _context_limit_notice(llm: LLM, request: Request) -> str | None:
    """A notice if the output was cut by max_model_len (the scheduler's cap), not by
    --max-new-tokens or EOS: both finish with reason "length"."""
    if not (request.finish_reason == "length" and len(request.all_ids) >= llm.max_model_len
            and request.num_output < request.params.max_tokens):
        return None
    return (f"note: the output stopped at the context limit, max_model_len {llm.max_model_len} "
            f"tokens ({len(request.prompt_ids)} of prompt, {request.num_output} generated; "
            f"--max-new-tokens {request.params.max_tokens} not reached)")


def _logprob_lines(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> list[str]:
    """One line per output token: the token (as a JSON string), its logprob, then the top
    alternatives with theirs."""
    def shown(token_id: int) -> str:
        return json.dumps(tokenizer.decode([token_id], skip_special_tokens=False),
                          ensure_ascii=False)

    width = max([len(shown(lp.token_id)) for lp in logprobs] + [5])
    lines = [f"{'token':<{width}} {'logprob':>9}" + ("   top" if logprobs[0].top else "")]
    for lp in logprobs:
        line = f"{shown(lp.token_id):<{width}} {lp.logprob:9.4f}"
        if lp.top:
            line += "   " + ", ".join(f"{shown(t)} {v:.4f}" for t, v in lp.top)
        lines.append(line)
    return lines


def _finish_reply(llm: LLM, reply: _Reply):
    """What follows a reply's text: its logprobs (stdout) and a context-limit notice."""
    click.echo()
    if reply.request.logprobs:
        click.echo("\n".join(["", *_logprob_lines(llm.tokenizer, reply.request.logprobs)]))
    if notice := _context_limit_notice(llm, reply.request):
        click.echo(notice, err=True)


@cli.command()
@click.option("--prompt", default=None,
              help="The prompt (the user message with --chat); - reads it from stdin, as does "
                   "leaving it out when stdin is not a terminal.")
@click.option("--chat", is_flag=True, help="Apply the checkpoint's chat template.")
@click.option("--system", default=None, help="A system message (implies --chat).")
@model_options
@sampling_options(default_max_new_tokens=128)
def generate(prompt, chat, system, model: ModelChoice, params: SamplingParams):
    """Generate text for one prompt, streamed to the terminal; a timing summary follows on
    stderr."""
    leader = model.join()
    if leader:
        prompt = _read_prompt(prompt)  # before the model loads: a missing prompt fails fast
    llm = model.load()
    if not leader:  # runs process 0's steps, prints nothing
        llm.follow()
        return
    _need_tokenizer(llm)
    chat = chat or system is not None
    if chat:
        system_message = [{"role": "system", "content": system}] if system is not None else []
        ids = llm.chat_prompt(system_message + [{"role": "user", "content": prompt}])
    else:
        ids = llm.tokenizer.encode(prompt)
    reply = _stream_reply(llm, ids, params, before="" if chat else prompt)
    _finish_reply(llm, reply)
    click.echo(_timing_line(reply), err=True)


@cli.command()
@click.option("--system", default=None, help="A system message, first in the history.")
@model_options
@sampling_options(default_max_new_tokens=512)
def chat(system, model: ModelChoice, params: SamplingParams):
    """Chat with the model (its chat template; the history is kept across turns). One
    message a line, from the terminal or piped stdin; replies are streamed. /reset clears
    the history, /exit or EOF ends. When the history outgrows max_model_len, the oldest
    turns are dropped (with a notice)."""
    leader = model.join()
    llm = model.load()
    if not leader:
        llm.follow()
        return
    _need_tokenizer(llm)
    if not llm.tokenizer.chat_template:
        raise JaxinferError(f"{llm.path}: the checkpoint has no chat template")
    interactive = sys.stdin.isatty()
    if interactive:
        click.echo(COMMANDS, err=True)

    def respond(ids: list[int]) -> str:
        """Streams the reply; returns its text (as far as shown, if Ctrl-C stopped it)."""
        reply = _stream_reply(llm, ids, params, stop_on_interrupt=True)
        _finish_reply(llm, reply)
        if reply.interrupted:
            click.echo("(reply stopped)", err=True)
        return reply.text

    run_chat(ChatHistory(system), read_lines(interactive), llm.chat_prompt, respond,
             llm.max_model_len, params.max_tokens, lambda notice: click.echo(notice, err=True))


@cli.command()
@click.argument("src")
@click.argument("out")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]),
              default="bfloat16", show_default=True,
              help="dtype of every float tensor (embeddings, norms, unquantized weights).")
@click.option("--quantize", default=None, metavar="FORMAT",
              help="Quantize the q/k/v/o and gate/up/down projections: int8 | int4 (one scale "
                   "per output channel) | int8:gN | int4:gN (N = 32, 64 or 128 inputs per "
                   "scale) | add :asym for zero points (e.g. int4:g128:asym) | fp8 (W8A8) | "
                   "fp8:weight-only | fp8:gN:weight-only | mxfp4 (e2m1, a power-of-two "
                   "scale per 32) | nvfp4 "
                   "(e2m1, an e4m3 scale per 16 times one per tensor) | none (all float). "
                   "Default: HF float weights stay float; a GGUF's Q4_0 / Q4_1 / Q8_0 "
                   "projections and an HF checkpoint's NVFP4 / FP8 ones stay as they are.")
def convert(src, out, dtype, quantize):
    """Convert an HF model directory or a .gguf file to a jaxinfer (Orbax) checkpoint."""
    path = convert_checkpoint(src, out, dtype=dtype, quantize=quantize)
    click.echo(f"wrote {path}")


cli.add_command(_bench_group)
cli.add_command(_serve_command)
cli.add_command(_plan_command)


if __name__ == "__main__":
    cli()
