"""Issue 38, item 1: `minserve chat` in a real terminal, `minserve generate` through the chat template, and
`LLM.chat` on one conversation or several, all on the embedded model."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from minserve import LLM, SamplingParams
from minserve.chat import ChatSession, run_chat
from minserve.cli import main

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


class Terminal:
    """A command on a pseudo-terminal: what it writes is read back, what a person types is sent."""

    def __init__(self, *args: str) -> None:
        self.fd, child = pty.openpty()
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "TERM": "dumb"}
        self.process = subprocess.Popen(args, stdin=child, stdout=child, stderr=child, env=env, close_fds=True)
        os.close(child)
        self.seen = ""

    def expect(self, text: str, timeout_s: float = 120.0) -> str:
        """Read until ``text`` has appeared since the last call; return what came before it."""
        deadline = time.monotonic() + timeout_s
        while text not in self.seen:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {text!r} within {timeout_s} s; the terminal shows {self.seen[-2000:]!r}")
            try:
                self.seen += os.read(self.fd, 4096).decode(errors="replace").replace("\r\n", "\n")
            except OSError as error:  # EIO: the command ended
                raise AssertionError(f"ended before {text!r}; the terminal shows {self.seen[-2000:]!r}") from error
        before, _, self.seen = self.seen.partition(text)
        return before

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        os.close(self.fd)


def test_minserve_chat_in_a_terminal(llm):
    """Greeting, a streamed reply that is the model's chat answer, /system, /reset, /help, Ctrl-D."""
    terminal = Terminal(sys.executable, "-m", "minserve.cli", "chat", "--temperature", "0", "--max-tokens", "4",
                        "--repetition-penalty", "1", "--ignore-eos")  # fmt: skip
    try:
        assert "minserve chat: minserve-tiny" in terminal.expect(">>> ")
        terminal.type("/system Be brief.\n")
        assert "[system prompt set: 'Be brief.']" in terminal.expect(">>> ")
        terminal.type("def fib(n):\n")
        reply = terminal.expect(">>> ")
        conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def fib(n):"}]
        assert llm.chat(conversation, GREEDY)[0].text in reply
        terminal.type("/reset\n")
        assert "[conversation forgotten]" in terminal.expect(">>> ")
        terminal.type("/help\n")
        assert "/exit" in terminal.expect(">>> ")
        terminal.type("\x04")  # Ctrl-D at an empty prompt: the end of input
        assert terminal.process.wait(timeout=60) == 0
    finally:
        terminal.close()


def test_a_session_keeps_its_history_and_leaves_on_exit(llm):
    session = ChatSession(llm, GREEDY)
    typed = iter(["hello", "/system Say yes.", "again", "/exit", "never read"])
    out = io.StringIO()
    assert run_chat(session, lambda prompt: next(typed), out) == 0
    first = llm.chat([{"role": "user", "content": "hello"}], GREEDY)[0].text
    second = llm.chat(
        [{"role": "system", "content": "Say yes."}, {"role": "user", "content": "hello"},
         {"role": "assistant", "content": first}, {"role": "user", "content": "again"}], GREEDY,
    )[0].text  # fmt: skip
    assert [t["content"] for t in session.turns] == ["hello", first, "again", second]
    assert out.getvalue() == f"{first}\n[system prompt set: 'Say yes.']\n{second}\n"
    session.command("/reset", out.write)
    assert session.turns == [] and session.system == "Say yes."


def test_ctrl_c_stops_a_reply_cancels_its_request_and_forgets_the_turn(llm):
    session = ChatSession(llm, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    written: list[str] = []

    def interrupt_after_two(text: str) -> None:
        written.append(text)
        if len(written) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.reply("def fib(n):", interrupt_after_two)
    assert session.turns == [] and llm.stats()["kv_blocks_used"] == 0  # the request was cancelled, blocks freed


def test_a_conversation_longer_than_the_context_is_refused_with_a_way_out(llm):
    out = io.StringIO()
    assert ChatSession(llm, GREEDY).reply("x " * 5000, out.write) is None
    assert "/reset to start over" in out.getvalue()


def test_llm_chat_takes_one_conversation_or_several_and_text_parts(llm):
    one = [{"role": "user", "content": "def add(a, b):"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]}]
    other = [{"role": "system", "content": "Python."}, {"role": "user", "content": "class A:"}]
    [alone] = llm.chat(one, GREEDY)
    both = llm.chat([one, other], [GREEDY, GREEDY])
    assert [o.token_ids for o in both] == [alone.token_ids, llm.chat(other, GREEDY)[0].token_ids]
    assert llm.chat(parts, GREEDY)[0].token_ids == alone.token_ids
    assert alone.prompt_token_ids == llm.encode_chat(one) == llm.tokenizer.encode_chat(one)[1]
    with pytest.raises(ValueError, match="conversation 1"):
        llm.chat([one, [{"role": "user", "content": [{"type": "image_url"}]}]], GREEDY)


def test_generate_answers_through_the_chat_template(llm, capsys):
    assert main(["generate", "def add(a, b):", "--max-tokens", "4", "--ignore-eos"]) == 0
    answer = llm.chat([{"role": "user", "content": "def add(a, b):"}], GREEDY)[0].text
    assert capsys.readouterr().out == answer + "\n"
    # (--raw, the prompt and its plain continuation: tests/test_cli.py)
    assert main(["chat", "--repetition-penalty", "0"]) == 2  # refused before a model loads
    assert "repetition_penalty" in capsys.readouterr().err
