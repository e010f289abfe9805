"""`deepinfer chat`: a REPL that keeps the conversation and applies the chat template."""

from __future__ import annotations

import signal
import sys
import threading

HELP = ("Type a message. Commands: /reset clears the history, /exit (or Ctrl-D) quits. Ctrl-C stops "
        "an answer; at the prompt it quits.")
INTERRUPTED = " [interrupted]"


class CtrlC:
    """While an answer streams, Ctrl-C is noted here and acted on between engine steps, so a step
    is never cut in half; elsewhere it raises KeyboardInterrupt as usual. (Signal handlers can
    only be set from the main thread: in any other thread Ctrl-C is left alone.)"""

    def __enter__(self) -> CtrlC:
        self.pressed = False
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.pressed = True

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


def run_chat(llm, params, system: str | None = None, stdin=sys.stdin, stdout=sys.stdout) -> int:
    """The REPL; returns the exit status (130 after Ctrl-C at the prompt)."""
    history = [{"role": "system", "content": system}] if system else []
    print(HELP, file=stdout)
    while True:
        stdout.write("> ")
        stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            stdout.write("\n")
            return 130
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        history.append({"role": "assistant", "content": answer(llm, llm.apply_chat_template(history), params, stdout)})


def answer(llm, prompt, params, stdout) -> str:
    """Stream one reply to stdout and return its text; Ctrl-C ends it early (the request is
    aborted and its blocks freed) and keeps what was written so far."""
    reply = ""
    with CtrlC() as ctrl_c:
        stream = llm.stream(prompt, params)
        for out in stream:
            reply += out.outputs[0].delta_text
            stdout.write(out.outputs[0].delta_text)
            stdout.flush()
            if ctrl_c.pressed:
                stream.close()  # runs llm.stream's finally: abort_request
                stdout.write(INTERRUPTED)
                break
    stdout.write("\n")
    return reply
