"""`edgespec chat` as a person uses it: a real pseudo-terminal, keys typed, the screen read back.

The process runs under a pty (pexpect), so Ctrl-C is the terminal's own interrupt character turned
into SIGINT by the kernel, and Ctrl-D is end-of-file on the terminal, exactly as at a keyboard.
"""

from __future__ import annotations

import os
import re
import signal
import sys

import pexpect
import pytest

from edgespec.chat_cli import PROMPT

STATS = re.compile(r"\[\d+ tokens in [^\]]*tok/s[^\]]*prefilled (\d+), reused (\d+) cached\]")


def spawn_chat(*args, timeout: int = 90, sigint_ignored: bool = False) -> pexpect.spawn:
    env = {**os.environ, "EDGESPEC_DEBUG": "", "TERM": "dumb", "PYTHONUNBUFFERED": "1"}
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    child = pexpect.spawn(sys.executable, ["-m", "edgespec.cli", "chat", *map(str, args)], env=env,
                          encoding="utf-8", timeout=timeout, dimensions=(50, 250), preexec_fn=ignore)
    child.expect("/help for commands")
    child.expect_exact(PROMPT)
    return child


def say(child: pexpect.spawn, line: str) -> tuple[int, int, str]:
    """Type a message; wait for the answer's stats line and the next prompt.
    Returns (tokens prefilled, tokens reused, what the screen showed)."""
    child.sendline(line)
    child.expect(STATS)
    shown, prefilled, reused = child.before, int(child.match.group(1)), int(child.match.group(2))
    child.expect_exact(PROMPT)
    return prefilled, reused, shown


def command(child: pexpect.spawn, line: str, expected: str) -> str:
    child.sendline(line)
    child.expect(expected)
    child.expect_exact(PROMPT)
    return child.before


@pytest.mark.slow
def test_a_chat_session_in_a_terminal(smollm2_path, tmp_path):
    saved = tmp_path / "chat.state"
    child = spawn_chat("--target", smollm2_path, "--system", "You are a helpful assistant.", "--temperature", 0,
                       "--mode", "ar", "-n", 300, "--ctx", 1024, "--threads", 1)
    try:
        prefilled_1, reused_1, shown = say(child, "What is the capital of France?")
        assert "Paris" in shown
        prefilled_2, reused_2, shown = say(child, "And the capital of Italy?")
        assert "Rome" in shown
        # The second turn reuses the first turn's KV and prefills only the new message.
        assert reused_1 == 0 and reused_2 > prefilled_1 and prefilled_2 < 25

        assert "reused from the cache" in command(child, "/stats", r"turns: 2 in the conversation")
        command(child, f"/save {saved}", r"saved 2 turns")
        assert saved.is_file()
        command(child, "/reset", r"conversation reset")
        command(child, f"/load {saved}", r"loaded 2 turns")
        command(child, "/stats", r"turns: 2 in the conversation")
        command(child, "/nonsense", r"unknown command /nonsense")
        command(child, "/help", r"/save FILE")

        # Ctrl-C at the prompt does not end the session.
        child.sendintr()
        child.expect("Ctrl-D or /quit ends the session")
        child.expect_exact(PROMPT)

        # Ctrl-C while an answer streams stops that answer; the session goes on.
        child.sendline("Write a very long story about a dragon and a knight, with many chapters.")
        child.expect_exact("chapters.")
        child.expect(r"\w+ \w+ \w+")  # the answer has started streaming
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect(STATS)
        assert int(child.after.split(" tokens in")[0].strip("[")) < 300
        child.expect_exact(PROMPT)
        _, reused_3, _ = say(child, "Give the story a title.")
        assert reused_3 > reused_2  # the interrupted answer stayed in the conversation and in the KV

        child.sendeof()  # Ctrl-D
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before

    # A smaller context: the saved chat is refused clearly, and a long conversation drops old turns.
    child = spawn_chat("--target", smollm2_path, "--temperature", 0, "--mode", "ar", "-n", 48, "--ctx", 256,
                       "--threads", 1)
    try:
        command(child, f"/load {saved}", r"error: cannot restore .*n_ctx differs \(saved 1024, now 256\)")
        for i in range(8):
            child.sendline(f"Tell me one fact about the number {i + 1}.")
            if child.expect([r"outgrew the context of 256 tokens: dropped the (\d+) oldest turn", STATS]) == 0:
                break
            child.expect_exact(PROMPT)
        else:
            pytest.fail("the conversation never outgrew 256 tokens")
        child.expect(STATS)  # the answer still comes
        child.expect_exact(PROMPT)
        command(child, "/stats", r"\(\d+ answered this session, [1-9]\d* dropped\)")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_c_works_when_started_with_sigint_ignored(smollm2_path):
    """A chat started in the background by a script inherits SIGINT ignored; Ctrl-C must still work."""
    child = spawn_chat("--target", smollm2_path, "--temperature", 0, "--mode", "ar", "--ctx", 256, "--threads", 1,
                       sigint_ignored=True, timeout=30)
    try:
        child.sendintr()
        child.expect("Ctrl-D or /quit ends the session")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
