"""`deepinfer chat`: a REPL that keeps the conversation and applies the chat template.

Replies sample with the model's defaults (`LLM.get_default_sampling_params`) unless a flag says
otherwise, and stop after CHAT_MAX_TOKENS tokens (`--max-tokens` changes the cap) or at the end of
the context. A conversation that outgrows the context drops its oldest turns (the system prompt
stays). On a terminal, lines are edited with readline and its history is kept across sessions.

Ctrl-C stops an answer. At the prompt, a first Ctrl-C only says how to leave and a second one in a
row leaves (exit status 130): a Ctrl-C meant for an answer that ended just before it lands at the
prompt, and must not end the session.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

BANNER = "Type a message; /help lists the commands. Ctrl-C stops an answer, Ctrl-D or /exit quits."
HELP = """commands:
  /help           this list
  /reset          clear the conversation (the system prompt stays)
  /system TEXT    set or replace the system prompt (/system alone shows it)
  /save FILE      write the conversation to FILE as JSON messages
  /stats          tokens and speed of the last reply, and the session's totals
  /exit, /quit    leave (so does Ctrl-D; Ctrl-C stops an answer, at the prompt it quits)"""
INTERRUPTED = " [interrupted]"  # an answer stopped by Ctrl-C
LENGTH_LIMIT = " [length limit]"  # an answer cut by --max-tokens or the end of the context
CHAT_MAX_TOKENS = 1024  # a reply's default cap (--max-tokens): a small model may otherwise ramble for minutes
MAX_REPLY_ROOM = 1024  # tokens kept free for a reply when old turns must go (at most half the context)
HISTORY_FILE = "chat_history"  # readline history, in the cache directory unless --history-file says
QUIT_HINT = "(Ctrl-C again, Ctrl-D or /exit to quit)"  # the answer to a first Ctrl-C at the prompt


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


# -- fitting the history into the context ------------------------------------------------------


class MessageTooLong(ValueError):
    """The newest message does not fit the context even with every older turn dropped."""

    def __init__(self, num_tokens: int, max_prompt_tokens: int):
        super().__init__(f"{num_tokens} prompt tokens, over the {max_prompt_tokens} the context leaves "
                         f"once room for a reply is kept")
        self.num_tokens, self.max_prompt_tokens = num_tokens, max_prompt_tokens


def fit_history(messages: list[dict], encode: Callable[[list[dict]], list[int]],
                max_prompt_tokens: int) -> tuple[list[dict], list[int]]:
    """The messages that fit, oldest first, and their prompt ids (`encode(kept)`).

    Drops the oldest turns after the system prompt (which stays) until the prompt has at most
    `max_prompt_tokens` ids. A turn is dropped with the replies that follow it, so what is kept
    still starts with a user message; the newest message is never dropped: when it cannot fit even
    alone, MessageTooLong. `messages` itself is left as it was. The prompt is encoded once when
    nothing has to go.
    """
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(head):]
    while True:
        ids = encode(head + turns)
        if len(ids) <= max_prompt_tokens:
            return head + turns, ids
        if len(turns) <= 1:
            raise MessageTooLong(len(ids), max_prompt_tokens)
        turns = turns[1:]
        while len(turns) > 1 and turns[0]["role"] != "user":
            turns = turns[1:]


def reply_room(max_tokens: int, max_model_len: int) -> int:
    """Tokens kept free for a reply when the history must shrink: `max_tokens`, but at most half the
    context and MAX_REPLY_ROOM (a reply may still run on into whatever the prompt leaves)."""
    return max(1, min(max_tokens, max_model_len // 2, MAX_REPLY_ROOM))


# -- one reply -----------------------------------------------------------------------------------


@dataclass
class ReplyStats:
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    num_output_tokens: int
    seconds: float  # from submitting the prompt to the last token

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds > 0 else 0.0


def answer(llm, prompt, params, stdout, ctrl_c: CtrlC) -> tuple[str, ReplyStats]:
    """Stream one reply to stdout and return its text and figures; the line ends with a marker when
    Ctrl-C stopped it (its request is aborted and its blocks freed; what was written is kept) or
    a length limit cut it. `ctrl_c` is entered by the caller."""
    reply, out, start = "", None, time.perf_counter()
    stream = llm.stream(prompt, params)
    for out in stream:
        reply += out.outputs[0].delta_text
        stdout.write(out.outputs[0].delta_text)
        stdout.flush()
        if ctrl_c.pressed:
            stream.close()  # runs llm.stream's finally: abort_request
            stdout.write(INTERRUPTED)
            break
    else:
        reason = out.outputs[0].finish_reason if out is not None else None
        if reason == "length":
            stdout.write(LENGTH_LIMIT)
        elif reason == "error":  # a fault ended this request; the engine and the session go on
            stdout.write(f" [error: {out.error}]")
    stdout.write("\n")
    num_output = len(out.outputs[0].token_ids) if out is not None else 0
    num_prompt = len(out.prompt_token_ids) if out is not None and out.prompt_token_ids else len(prompt)
    stats = ReplyStats(num_prompt, out.num_cached_tokens if out is not None else 0, num_output,
                       time.perf_counter() - start)
    return reply, stats


# -- the session ---------------------------------------------------------------------------------


class ChatSession:
    """The conversation (system prompt + turns), the reply figures and the slash commands."""

    def __init__(self, llm, params, system: str | None, stdout):
        self.llm, self.params, self.system, self.stdout = llm, params, system, stdout
        self.turns: list[dict] = []  # user and assistant messages, oldest first
        self.stats: list[ReplyStats] = []

    @property
    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def say(self, text: str) -> None:
        self.stdout.write(text + "\n")
        self.stdout.flush()

    def send(self, text: str) -> None:
        """One user turn: fit the history into the context, stream the reply, keep both. Ctrl-C from
        Enter on stops the reply (at the latest after its first step), never the session."""
        with CtrlC() as ctrl_c:
            self._send(text, ctrl_c)

    def _send(self, text: str, ctrl_c: CtrlC) -> None:
        max_model_len = self.llm.engine.max_model_len
        room = reply_room(self.params.max_tokens, max_model_len)
        try:
            kept, ids = fit_history([*self.messages, {"role": "user", "content": text}],
                                    self.llm.apply_chat_template, max_model_len - room)
        except MessageTooLong as exc:
            self.say(f"[message not sent: {exc} ({max_model_len}-token context, {room} kept for the reply)]")
            return
        num_dropped = len(self.messages) + 1 - len(kept)
        if num_dropped:
            self.say(f"[dropped {num_dropped} oldest message{'s' if num_dropped > 1 else ''} "
                     f"to fit the {max_model_len}-token context]")
        params = dataclasses.replace(self.params, max_tokens=min(self.params.max_tokens, max_model_len - len(ids)))
        try:
            reply, stats = answer(self.llm, ids, params, self.stdout, ctrl_c)
        except ValueError as exc:  # the engine refused the request (e.g. the KV cache cannot hold it)
            self.say(f"[message not sent: {exc}]")
            return
        self.turns = [*(kept[1:] if self.system else kept), {"role": "assistant", "content": reply}]
        self.stats.append(stats)

    def command(self, line: str) -> bool:
        """Run one /command; False when it asks to leave."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        handlers = {"/help": lambda: self.say(HELP), "/reset": self.reset, "/system": lambda: self.set_system(arg),
                    "/save": lambda: self.save(arg), "/stats": lambda: self.say(self.stats_text())}
        handler = handlers.get(name)
        if handler is None:
            self.say(f"unknown command {name}; /help lists the commands")
        else:
            handler()
        return True

    def reset(self) -> None:
        self.turns = []
        self.say("history cleared" + (" (the system prompt stays)" if self.system else ""))

    def set_system(self, text: str) -> None:
        if not text:
            self.say(f"system prompt: {self.system}" if self.system else "no system prompt; /system TEXT sets one")
            return
        verb = "replaced" if self.system else "set"
        self.system = text
        self.say(f"system prompt {verb}: {text}")

    def save(self, path: str) -> None:
        if not path:
            self.say("usage: /save FILE")
            return
        try:
            with open(os.path.expanduser(path), "w", encoding="utf-8") as f:
                json.dump(self.messages, f, indent=2, ensure_ascii=False)
                f.write("\n")
        except OSError as exc:
            self.say(f"could not save to {path}: {exc.strerror or exc}")
            return
        self.say(f"saved {len(self.messages)} messages to {path}")

    def stats_text(self) -> str:
        if not self.stats:
            return "no replies yet"
        last = self.stats[-1]
        total_out = sum(s.num_output_tokens for s in self.stats)
        total_prompt = sum(s.num_prompt_tokens for s in self.stats)
        total_cached = sum(s.num_cached_tokens for s in self.stats)
        total_seconds = sum(s.seconds for s in self.stats)
        return (f"last reply: {last.num_output_tokens} tokens in {last.seconds:.2f} s "
                f"({last.tokens_per_second:.1f} tok/s); prompt {last.num_prompt_tokens} tokens, "
                f"{last.num_cached_tokens} cached\n"
                f"session: {len(self.stats)} replies, {total_out} tokens in {total_seconds:.2f} s; "
                f"prompts {total_prompt} tokens, {total_cached} cached")


# -- reading lines -------------------------------------------------------------------------------


def default_history_file() -> str | None:
    """Where typed lines are remembered: the deepinfer cache directory's chat_history."""
    from deepinfer.model_executor.loader.fingerprint import default_cache_dir

    cache_dir = default_cache_dir()
    return os.path.join(cache_dir, HISTORY_FILE) if cache_dir else None


def line_editing(history_file: str | None) -> Callable[[], None] | None:
    """Turn on readline for input() (arrows, editing, Up for earlier lines) and load the history
    file; returns the function that saves it, or None where Python has no readline."""
    try:
        import readline
    except ImportError:
        return None
    readline.set_history_length(1000)
    if history_file and os.path.isfile(history_file):
        try:
            readline.read_history_file(history_file)
        except OSError:
            pass  # an unreadable history is no reason to refuse a chat

    def save() -> None:
        if history_file:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(history_file)), exist_ok=True)
                readline.write_history_file(history_file)
            except OSError:
                pass

    return save


def read_line(stdin, stdout, interactive: bool) -> str | None:
    """The next line without its newline; None at end of input. Ctrl-C raises KeyboardInterrupt."""
    if interactive:
        try:
            return input("> ")
        except EOFError:
            stdout.write("\n")
            return None
    stdout.write("> ")
    stdout.flush()
    line = stdin.readline()
    return line.rstrip("\n") if line else None


def run_chat(llm, params, system: str | None = None, stdin=sys.stdin, stdout=sys.stdout,
             history_file: str | None = None) -> int:
    """The REPL; returns the exit status (130 after Ctrl-C at the prompt). `params.max_tokens` caps
    each reply (which also stops at the end of the context). On a terminal (stdin is the process's
    own and a tty) lines are read with readline, their history kept in `history_file`."""
    interactive = stdin is sys.stdin and stdin.isatty()
    save_history = line_editing(history_file) if interactive else None
    session = ChatSession(llm, params, system, stdout)
    session.say(BANNER)
    quit_armed = False  # the last thing typed was a Ctrl-C at the prompt
    try:
        while True:
            try:
                status = _one_line(session, stdin, stdout, interactive)
            except KeyboardInterrupt:  # at the prompt, or between an answer's end and the prompt
                stdout.write("\n")
                if quit_armed:
                    return 130
                session.say(QUIT_HINT)
                quit_armed = True
                continue
            quit_armed = False
            if status is not None:
                return status
    finally:
        if save_history is not None:
            save_history()


def _one_line(session: ChatSession, stdin, stdout, interactive: bool) -> int | None:
    """Read and act on one line; the exit status when the session ends, else None."""
    line = read_line(stdin, stdout, interactive)
    if line is None:
        return 0
    text = line.strip()
    if text.startswith("/"):
        return None if session.command(text) else 0
    if text:
        session.send(line)
    return None


# -- the command line ----------------------------------------------------------------------------


def chat_params(args, llm):
    """The reply sampling: explicit flags, else the model's defaults; max_tokens: --max-tokens
    (CHAT_MAX_TOKENS unless given; each turn also caps it at what the prompt leaves)."""
    from deepinfer.entrypoints.engine_args import sampling_params

    return sampling_params(args, llm.get_default_sampling_params())
