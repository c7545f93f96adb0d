"""`jaxinfer generate` and `jaxinfer chat` on the default model (SmolLM2-135M), through click's
CliRunner: stdin prompts, --system, --stop, --logprobs, the timing summary, the context-limit
notice, chat history, and one-line errors. The commands run on one LLM built once for the
module (loading it per invocation would dominate the time)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from click.testing import CliRunner

from jaxinfer import LLM, JaxinferError, SamplingParams
from jaxinfer.cli import main
from jaxinfer.cli.chat import ChatHistory
from jaxinfer.cli.main import cli

MAX_MODEL_LEN = 96
SUMMARY = re.compile(r"prompt: (\d+) tokens, [\d.]+ tokens/s \| generated: (\d+) tokens, "
                     r"[\d.]+ tokens/s \| TTFT: [\d.]+ ms")


@pytest.fixture(scope="module")
def llm(smollm2_converted):
    return LLM(smollm2_converted, max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def run(llm, monkeypatch):
    """run(command, *args, input=None): the CLI with --max-model-len MAX_MODEL_LEN, on `llm`."""

    def load(path, **kwargs):
        assert path is None and kwargs["max_model_len"] == MAX_MODEL_LEN  # llm's model
        return llm

    monkeypatch.setattr(main, "LLM", load)

    def invoke(command, *args, input=None):
        return CliRunner().invoke(cli, [command, "--max-model-len", str(MAX_MODEL_LEN),
                                        *map(str, args)], input=input)

    return invoke


@pytest.fixture
def prompts_sent(llm, monkeypatch):
    """The (prompt ids, Request) of every request the CLI streams, in order."""
    sent = []
    stream_request = llm.stream_request

    def recording(ids, params):
        request, deltas = stream_request(ids, params)
        sent.append((ids, request))
        return request, deltas

    monkeypatch.setattr(llm, "stream_request", recording)
    return sent


def greedy(llm, prompt, max_tokens, **kwargs):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                               **kwargs))[0]


def error_line(result) -> str:
    """The one line a failed command printed (which must start with "Error: ")."""
    assert result.exit_code != 0 and not isinstance(result.exception, JaxinferError)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.mark.parametrize("args", [[], ["--prompt", "-"]], ids=["no-prompt", "prompt-dash"])
def test_generate_reads_the_prompt_from_stdin(run, llm, args):
    prompt = "The capital of France is"
    result = run("generate", *args, "--max-new-tokens", 6, input=prompt + "\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == prompt + greedy(llm, prompt, 6).text + "\n"


def test_generate_without_a_prompt_is_a_one_line_error(run, monkeypatch):
    assert error_line(run("generate", input="\n")) == "Error: the prompt read from stdin is empty"

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    with pytest.raises(JaxinferError, match="no prompt: give --prompt TEXT"):
        main._read_prompt(None)


def test_generate_system_message_uses_the_chat_template(run, llm, prompts_sent):
    system = "You are a pirate. Answer like one."
    result = run("generate", "--system", system, "--prompt", "Who are you?",
                 "--max-new-tokens", 8)
    assert result.exit_code == 0, result.output
    ids = llm.chat_prompt([{"role": "system", "content": system},
                           {"role": "user", "content": "Who are you?"}])
    assert [sent for sent, _ in prompts_sent] == [ids]
    assert llm.tokenizer.encode(" pirate", add_special_tokens=False)[0] in ids
    assert result.stdout == greedy(llm, ids, 8).text + "\n"  # the prompt is not echoed


def test_stop_cuts_the_text(run, llm):
    prompt = "The capital of France is"
    free = greedy(llm, prompt, 12).text
    stop = free.split()[2]  # a word well inside the text
    result = run("generate", "--prompt", prompt, "--max-new-tokens", 12, "--stop", "#never#",
                 "--stop", stop)
    assert result.exit_code == 0, result.output
    assert result.stdout == prompt + free[:free.index(stop)] + "\n"


def test_summary_line_on_stderr(run, llm):
    prompt = "Once upon a time"
    expected = greedy(llm, prompt, 5, ignore_eos=True)
    result = run("generate", "--prompt", prompt, "--max-new-tokens", 5)
    assert result.exit_code == 0, result.output
    assert result.stdout == prompt + expected.text + "\n"
    found = [m for line in result.stderr.splitlines() if (m := SUMMARY.fullmatch(line))]
    assert len(found) == 1, result.stderr
    assert int(found[0][1]) == len(llm.tokenizer.encode(prompt))
    assert int(found[0][2]) == len(expected.token_ids)
    assert "context limit" not in result.stderr  # --max-new-tokens cut it


def test_context_limit_notice(run, llm):
    prompt = " ".join(f"{n}," for n in range(1, 22))  # "1, 2, ..." goes on counting
    num_prompt = len(llm.tokenizer.encode(prompt))
    room = MAX_MODEL_LEN - num_prompt
    assert 0 < room < 30
    assert greedy(llm, prompt, 30).finish_reason == "length"
    result = run("generate", "--prompt", prompt, "--max-new-tokens", 30)
    assert result.exit_code == 0, result.output
    notices = [line for line in result.stderr.splitlines() if "context limit" in line]
    assert notices == [f"note: the output stopped at the context limit, max_model_len "
                       f"{MAX_MODEL_LEN} tokens ({num_prompt} of prompt, {room} generated; "
                       "--max-new-tokens 30 not reached)"], result.stderr
    assert SUMMARY.search(result.stderr)[2] == str(room)


def test_logprobs_follow_the_text(run, llm):
    prompt = "The capital of France is"
    expected = greedy(llm, prompt, 4, logprobs=2)
    result = run("generate", "--prompt", prompt, "--max-new-tokens", 4, "--logprobs", 2)
    assert result.exit_code == 0, result.output
    text = prompt + expected.text + "\n\n"  # the table follows a blank line
    assert result.stdout.startswith(text)
    header, *rows = result.stdout[len(text):].splitlines()
    assert header.split() == ["token", "logprob", "top"]
    assert len(rows) == len(expected.token_ids)
    for row, lp in zip(rows, expected.logprobs, strict=True):
        numbers = [float(x) for x in re.findall(r'"\s+(-?\d+\.\d{4})', row)]
        assert numbers == pytest.approx([lp.logprob] + [v for _, v in lp.top], abs=1e-3)
        assert len(lp.top) == 2


def test_chat_keeps_the_history(run, llm, prompts_sent):
    first, second = "What is the capital of France?", "And of Germany?"
    result = run("chat", "--max-new-tokens", 12,
                 input=f"{first}\n\n{second}\n/exit\nnot a message\n")
    assert result.exit_code == 0, result.output
    assert len(prompts_sent) == 2
    (ids1, reply1), (ids2, reply2) = prompts_sent
    assert reply1.text and ids1 == llm.chat_prompt([{"role": "user", "content": first}])
    assert ids2 == llm.chat_prompt([{"role": "user", "content": first},
                                    {"role": "assistant", "content": reply1.text},
                                    {"role": "user", "content": second}])
    assert result.stdout == f"{reply1.text}\n{reply2.text}\n"


def test_chat_reset_too_long_and_dropped_turns(run, llm, prompts_sent):
    system = "Answer in one word."
    too_long = " ".join(["word"] * MAX_MODEL_LEN)
    long_enough = "Name a colour. " * 15  # the history must make way for it
    lines = ["Hi", "/reset", too_long, "Hello", long_enough]
    result = run("chat", "--system", system, "--max-new-tokens", 8,
                 input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    messages = [[{"role": "system", "content": system}, {"role": "user", "content": text}]
                for text in ("Hi", "Hello", long_enough.strip())]
    assert [ids for ids, _ in prompts_sent] == [llm.chat_prompt(m) for m in messages]
    notices = [line for line in result.stderr.splitlines()
               if line.startswith(("history", "Error", "dropped"))]
    assert len(notices) == 3, result.stderr
    assert notices[0] == "history cleared"
    assert notices[1].startswith("Error: this message takes ")
    assert notices[2].startswith("dropped the oldest 1 turn of the history")
    # without the drop, the prompt would not have left --max-new-tokens of room
    kept = messages[2][:1] + [{"role": "user", "content": "Hello"},
                              {"role": "assistant", "content": prompts_sent[1][1].text},
                              messages[2][1]]
    assert len(llm.chat_prompt(kept)) + 8 > MAX_MODEL_LEN


def test_ctrl_c_stops_the_reply_not_the_chat(run, llm, monkeypatch):
    stream_request = llm.stream_request
    sent = []

    def interrupted_after_one_delta(ids, params):
        request, deltas = stream_request(ids, params)
        sent.append((ids, request))

        def one_then_ctrl_c():
            with contextlib.closing(deltas):
                yield next(deltas)
                if len(sent) == 1:
                    raise KeyboardInterrupt
                yield from deltas

        return request, one_then_ctrl_c()

    monkeypatch.setattr(llm, "stream_request", interrupted_after_one_delta)
    result = run("chat", "--max-new-tokens", 8, input="Tell me a story.\nGo on.\n")
    assert result.exit_code == 0, result.output
    assert "(reply stopped)" in result.stderr
    (_, first), (ids, second) = sent
    partial = first.text[:first.num_emitted_chars]
    assert first.finish_reason == "abort" and partial
    assert ids == llm.chat_prompt([{"role": "user", "content": "Tell me a story."},
                                   {"role": "assistant", "content": partial},
                                   {"role": "user", "content": "Go on."}])
    assert result.stdout == f"{partial}\n{second.text}\n"
    assert not llm.engine.has_unfinished()


def _render(messages):
    """A stand-in chat template: one token per character of each message, plus 2."""
    return [0] * sum(len(m["content"]) + 2 for m in messages)


@pytest.mark.parametrize("max_len,reply_room,dropped", [
    (73, 10, 0),  # all three turns fit with room for the reply
    (72, 10, 1),
    (45, 10, 2),  # two turns dropped make room for the reply
    (20, 30, 3),  # no history leaves 30 tokens: the prompt alone still fits
])
def test_chat_history_fit_drops_the_oldest_turns(max_len, reply_room, dropped):
    history = ChatHistory("sys")  # 5 tokens
    turns = [("aaaa", "bbbbbbbb"), ("cccc", "dddddddd"), ("eeee", "ffffffff")]  # 16 each
    history.turns = list(turns)
    ids, num_dropped = history.fit("question", _render, max_len, reply_room)  # 10
    assert num_dropped == dropped and history.turns == turns[dropped:]
    assert len(ids) == 5 + 16 * (3 - dropped) + 10


def test_chat_history_fit_leaves_the_history_when_the_message_cannot_fit():
    history = ChatHistory()
    history.add("aaaa", "bbbb")
    with pytest.raises(JaxinferError, match="this message takes 22 tokens with the chat "
                                            "template; max_model_len is 20"):
        history.fit("x" * 20, _render, 20, 5)
    assert history.turns == [("aaaa", "bbbb")]


@pytest.mark.parametrize("args,names", [
    (["--logprobs", 99], "'--logprobs': 99 is not in the range 0<=x<=20"),
    (["--min-p", 1.5], "'--min-p': 1.5 is not in the range 0<=x<=1"),
    (["--stop", ""], "stop=['']: must be non-empty strings"),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_sampling_flags_are_one_line_errors(run, command, args, names):
    line = error_line(run(command, "--prompt", "hi", *args) if command == "generate"
                      else run(command, *args, input="hi\n"))
    assert names in line


def test_memory_flags_reach_the_llm(monkeypatch):
    built = {}

    def load(path, **kwargs):
        built.update(kwargs, path=path)
        raise JaxinferError("not loaded")

    monkeypatch.setattr(main, "LLM", load)
    result = CliRunner().invoke(cli, ["chat", "--model", "somewhere", "--kv-cache-gb", "0.5",
                                      "--page-size", "32", "--decode-steps", "4",
                                      "--max-model-len", "512", "--dtype", "float32",
                                      "--scan-layers", "--gpu-memory-utilization", "0.5",
                                      "--kv-cache-dtype", "fp8", "--batch-invariant"])
    assert error_line(result) == "Error: not loaded"
    assert built == dict(path="somewhere", dtype="float32", kv_cache_bytes=2**29,
                         max_model_len=512, page_size=32, max_num_seqs=1, decode_steps=4,
                         mesh=None, scan_layers=True, gpu_memory_utilization=0.5,
                         kv_cache_dtype="fp8", batch_invariant=True)
    # Without --kv-cache-gb the LLM sizes the cache for its one sequence.
    CliRunner().invoke(cli, ["generate", "--model", "somewhere", "--prompt", "hi"])
    assert built["kv_cache_bytes"] is None and built["max_num_seqs"] == 1
    assert built["kv_cache_dtype"] == "auto" and built["batch_invariant"] is False
