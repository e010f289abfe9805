"""`deepinfer chat`: a REPL that keeps the conversation and applies the chat template."""

from __future__ import annotations

import sys

HELP = "Type a message. Commands: /reset clears the history, /exit (or Ctrl-D) quits."


def run_chat(llm, params, system: str | None = None, stdin=sys.stdin, stdout=sys.stdout) -> int:
    history = [{"role": "system", "content": system}] if system else []
    print(HELP, file=stdout)
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        reply = ""
        for out in llm.stream(llm.apply_chat_template(history), params):
            reply += out.outputs[0].delta_text
            stdout.write(out.outputs[0].delta_text)
            stdout.flush()
        stdout.write("\n")
        history.append({"role": "assistant", "content": reply})
