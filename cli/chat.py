"""The `jaxinfer chat` session: the conversation's history, fitted to the context, and the loop
over the user's lines (the click command and the model's streamed replies are in cli/main.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from jaxinfer.errors import JaxinferError

COMMANDS = "/reset clears the history, /exit (or Ctrl-D) ends the chat"


class ChatHistory:
    """The conversation so far: an optional system message, then (user, assistant) turns."""

    def __init__(self, system: str | None = None):
        self.system = system
        self.turns: list[tuple[str, str]] = []

    def messages(self, user: str, first_turn: int = 0) -> list[dict]:
        """The chat messages [{"role", "content"}] of turns[first_turn:], then `user`."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for asked, answered in self.turns[first_turn:]:
            messages += [{"role": "user", "content": asked},
                         {"role": "assistant", "content": answered}]
        return messages + [{"role": "user", "content": user}]

    def fit(self, user: str, render: Callable[[list[dict]], list[int]], max_len: int,
            reply_room: int) -> tuple[list[int], int]:
        """The prompt ids for `user` after the history (render: messages -> token ids), with
        as many of the latest turns as leave `reply_room` tokens for the reply within
        max_len; if even no history leaves that much, as many as still let the prompt
        itself fit (the reply is then cut short). The turns left out are dropped from the
        history for good. Returns the ids and how many turns were dropped."""
        prompts: dict[int, list[int]] = {}  # first turn kept -> prompt ids, rendered once
        for room in (reply_room, 1):  # the engine needs a prompt of at most max_len - 1
            for first in range(len(self.turns) + 1):
                if first not in prompts:
                    prompts[first] = render(self.messages(user, first))
                if len(prompts[first]) + room <= max_len:
                    del self.turns[:first]
                    return prompts[first], first
        alone = len(prompts[len(self.turns)])
        raise JaxinferError(f"this message takes {alone} tokens with the chat template"
                            f"{' and the system message' if self.system else ''}; "
                            f"max_model_len is {max_len}")

    def add(self, user: str, reply: str):
        self.turns.append((user, reply))

    def reset(self):
        self.turns.clear()


def read_lines(interactive: bool) -> Iterator[str]:
    """The user's lines until EOF: with a `> ` prompt and line editing on a terminal, else
    plainly from stdin (a pipe or a file)."""
    if interactive:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and not line:
            return
        yield line.rstrip("\r\n")


def run_chat(history: ChatHistory, lines: Iterator[str], render: Callable[[list[dict]], list[int]],
             respond: Callable[[list[int]], str], max_len: int, reply_room: int,
             say: Callable[[str], None]):
    """The chat loop: each line is a command or a user message, answered by respond(prompt
    ids) -> the reply's text, which joins the history. `say` shows notices to the user
    (not part of the conversation)."""
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            history.reset()
            say("history cleared")
            continue
        if text == "/help":
            say(COMMANDS)
            continue
        try:
            ids, dropped = history.fit(text, render, max_len, reply_room)
        except JaxinferError as e:  # this message only: the session goes on
            say(f"Error: {e}")
            continue
        if dropped:
            say(f"dropped the oldest {dropped} turn{'s' if dropped > 1 else ''} of the history "
                f"to fit max_model_len ({max_len} tokens); /reset clears it all")
        history.add(text, respond(ids))
