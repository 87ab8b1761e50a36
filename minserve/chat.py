"""``minserve chat``: a conversation with a model in the terminal, as ``ollama run`` and ``llama-cli -cnv`` hold one.

Each turn sends the whole conversation through the model's chat template (:meth:`minserve.LLM.encode_chat`)
and streams the reply as it is generated. The earlier turns' full KV blocks are in the prefix cache, so a
turn prefills little more than what is new. What you can type at the ``>>>`` prompt:

    /system TEXT   set the system prompt (/system alone shows it, /system - removes it)
    /reset         forget the conversation (the system prompt stays)
    /help          these commands
    /exit          leave (so do /quit, /bye and Ctrl-D)

Ctrl-C stops a reply early: its request is cancelled and the turn forgotten. At the prompt Ctrl-C clears the
line, as in a shell. ``minserve generate`` shares the sampling flags (:func:`add_sampling_flags`).

This module imports only the standard library at import time; the engine loads when a command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from minserve import LLM, SamplingParams

EXIT_COMMANDS = ("/exit", "/quit", "/bye")
HELP = """/system TEXT   set the system prompt (/system alone shows it, /system - removes it)
/reset         forget the conversation (the system prompt stays)
/help          these commands
/exit          leave (so do /quit, /bye and Ctrl-D); Ctrl-C stops a reply"""
DESCRIPTION = "Chat with a model in the terminal; each reply streams as it is generated. At the >>> prompt:\n\n" + HELP
# A chat's sampling defaults are Ollama's (`ollama run`): greedy decoding of a small chat model loops ("a
# moment of stillness, a fleeting sight," again and again), and a mild repetition penalty and sampling stop it.
CHAT_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1}


def add_sampling_flags(parser: argparse.ArgumentParser, chat: bool = False) -> None:
    """The sampling flags of ``generate`` (greedy by default) and ``chat`` (:data:`CHAT_DEFAULTS`)."""
    defaults = CHAT_DEFAULTS if chat else {}
    group = parser.add_argument_group("sampling")
    add = group.add_argument
    most = "what the context leaves" if chat else "%(default)s"
    add("--max-tokens", type=int, default=None if chat else 64, help=f"tokens per reply at most (default: {most})")
    add("--temperature", type=float, default=defaults.get("temperature", 0.0), help="0 = greedy (default: %(default)s)")
    add("--top-k", type=int, default=defaults.get("top_k", 0), help="0 = off (default: %(default)s)")
    add("--top-p", type=float, default=defaults.get("top_p", 1.0), help="1 = off (default: %(default)s)")
    add("--min-p", type=float, default=0.0, help="drop tokens below MIN_P × the most likely one's probability")
    add("--repetition-penalty", type=float, default=defaults.get("repetition_penalty", 1.0),
        help="> 1 makes tokens of the prompt and the output less likely; 1 = off (default: %(default)s)")  # fmt: skip
    add("--frequency-penalty", type=float, default=0.0, help="-2 … 2, subtracted per time a token was generated")
    add("--presence-penalty", type=float, default=0.0, help="-2 … 2, subtracted once a token was generated")
    add("--seed", type=int, default=None)
    add("--stop", action="append", help="a stop string (repeatable)")
    add("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags of :func:`add_sampling_flags` as :class:`~minserve.SamplingParams`, checked (a bad value
    raises ``ValueError`` naming it) before any model loads."""
    from minserve import SamplingParams

    return SamplingParams(
        # chat may leave --max-tokens unset: its cap is then the context, known once the model has loaded
        max_tokens=1 if args.max_tokens is None else args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )


@dataclasses.dataclass
class ChatSession:
    """One conversation with ``llm``: its system prompt, its turns so far, and how to sample a reply (a reply
    is at most ``params.max_tokens`` long, and at most what the context leaves after the conversation)."""

    llm: LLM
    params: SamplingParams
    system: str | None = None
    turns: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def messages(self, user_text: str) -> list[dict[str, str]]:
        """The conversation as the chat template takes it, with ``user_text`` as the newest turn."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.turns, {"role": "user", "content": user_text}]

    def reply(self, user_text: str, write: Callable[[str], object]) -> str | None:
        """Stream the model's answer to ``user_text`` through ``write`` and keep both turns; ``None`` (and
        nothing kept) if the conversation no longer fits the context. Ctrl-C cancels the reply and re-raises."""
        ids = self.llm.encode_chat(self.messages(user_text))
        room = self.llm.max_model_len - len(ids)
        if room < 1:
            write(f"[the conversation is {len(ids)} tokens and the context holds {self.llm.max_model_len}: "
                  "/reset to start over]\n")  # fmt: skip
            return None
        params = dataclasses.replace(self.params, max_tokens=min(self.params.max_tokens, room))
        pieces = []
        stream = self.llm.stream(ids, params)
        try:
            for output in stream:
                pieces.append(output.delta_text)
                write(output.delta_text)
        finally:
            stream.close()  # after Ctrl-C too: closing the stream cancels the request and frees its blocks
        answer = "".join(pieces)
        self.turns += [{"role": "user", "content": user_text}, {"role": "assistant", "content": answer}]
        return answer

    def command(self, line: str, write: Callable[[str], object]) -> None:
        """Carry out a ``/`` command other than leaving."""
        name, _, rest = line.partition(" ")
        if name == "/reset":
            self.turns.clear()
            write("[conversation forgotten]\n")
        elif name == "/system" and not rest.strip():
            write(f"[system prompt: {self.system!r}]\n" if self.system else "[no system prompt]\n")
        elif name == "/system":
            self.system = None if rest.strip() == "-" else rest.strip()
            write(f"[system prompt set: {self.system!r}]\n" if self.system else "[system prompt removed]\n")
        else:
            write(("" if name == "/help" else f"[unknown command {name}]\n") + HELP + "\n")


def run_chat(session: ChatSession, read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> int:
    """The read–answer loop until ``/exit`` or the end of input (Ctrl-D). Returns the exit status, 0."""

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    while True:
        try:
            line = read(">>> ").strip()
        except EOFError:  # Ctrl-D
            write("\n")
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, as in a shell
            write("\n[/exit or Ctrl-D to leave]\n")
            continue
        if line in EXIT_COMMANDS:
            return 0
        if line.startswith("/"):
            session.command(line, write)
        elif line:
            try:
                if session.reply(line, write) is not None:
                    write("\n")
            except KeyboardInterrupt:
                write("\n[stopped; this turn is forgotten]\n")


def start_chat(llm: LLM, params: SamplingParams, args: argparse.Namespace) -> int:
    """``minserve chat`` once its model is loaded: a greeting, then :func:`run_chat` on the terminal."""
    if llm.tokenizer.chat_template is None:
        raise ValueError(f"{args.model} has no chat template; `minserve generate --raw` completes plain text")
    parameters = sum(p.numel() for p in llm.model.parameters())
    print(f"minserve chat: {args.model} ({parameters / 1e6:.1f}M parameters, {llm.device}). "
          "/help for commands, /exit or Ctrl-D to leave.")  # fmt: skip
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):  # not on every platform; input() works without it
            import readline  # noqa: F401  (line editing and history for input())
    params = dataclasses.replace(params, max_tokens=args.max_tokens or llm.max_model_len)  # capped per reply
    return run_chat(ChatSession(llm, params, args.system))
