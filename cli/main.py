"""`jaxinfer generate | convert | serve | bench | plan`: thin click commands over the library.

Every user-facing failure is a JaxinferError, printed as one line
(`error: ...`) with exit status 1; no traceback reaches the user.
"""

from __future__ import annotations

import functools
import sys

import click

from jaxinfer.cli.bench import bench as _bench_group
from jaxinfer.cli.parallel import join_job, parallel_options
from jaxinfer.cli.plan import plan as _plan_command
from jaxinfer.cli.serve import serve as _serve_command
from jaxinfer.engine.request import SamplingParams
from jaxinfer.errors import JaxinferError
from jaxinfer.llm import LLM
from jaxinfer.loading.checkpoint import convert as convert_checkpoint


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
        return _user_errors(super().invoke)(ctx)


@click.group(cls=_Group)
@click.version_option(package_name="jaxinfer")
def cli():
    """jaxinfer: LLM inference in JAX/Pallas."""


@cli.command()
@click.option("--model", "model_path", default=None,
              help="Converted dir, HF dir or .gguf file (default: embedded SmolLM2-135M-Instruct).")
@click.option("--prompt", required=True, help="The prompt (the user message with --chat).")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=-1),
              help="0 or -1 disables.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--chat", is_flag=True, help="Apply the checkpoint's chat template.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default=None,
              help="Compute dtype (default: as stored; bfloat16 for HF/GGUF sources).")
@parallel_options
def generate(model_path, prompt, max_new_tokens, temperature, top_p, top_k, seed, chat, dtype,
             mesh, coordinator, num_processes, process_id):
    """Generate text for one prompt, streamed to the terminal."""
    leader = join_job(coordinator, num_processes, process_id)
    llm = LLM(model_path, dtype=dtype, mesh=mesh)
    if not leader:  # runs process 0's steps, prints nothing
        llm.follow()
        return
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                            max_tokens=max_new_tokens, seed=seed)
    if llm.tokenizer is None:
        raise JaxinferError(f"{llm.path}: the checkpoint has no tokenizer")
    if chat:
        ids = llm.chat_prompt([{"role": "user", "content": prompt}])
    else:
        ids = llm.tokenizer.encode(prompt)
    deltas = llm.stream(ids, params)  # raises here if the prompt does not fit
    if not chat:
        click.echo(prompt, nl=False)
    for delta in deltas:
        click.echo(delta, nl=False)
    click.echo()


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
                   "fp8:weight-only | none (all float). Default: HF weights stay float; a "
                   "GGUF keeps its Q4_0 / Q4_1 / Q8_0 projections as they are.")
def convert(src, out, dtype, quantize):
    """Convert an HF model directory or a .gguf file to a jaxinfer (Orbax) checkpoint."""
    path = convert_checkpoint(src, out, dtype=dtype, quantize=quantize)
    click.echo(f"wrote {path}")


cli.add_command(_bench_group)
cli.add_command(_serve_command)
cli.add_command(_plan_command)


if __name__ == "__main__":
    cli()
