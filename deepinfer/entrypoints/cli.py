"""The `deepinfer` command: generate, chat, run, bench, info, serve; pull, list, rm (each with --help)."""

from __future__ import annotations

import argparse
import sys

from deepinfer.entrypoints.engine_args import add_engine_args, add_sampling_args, make_llm, sampling_params


def read_prompt(arg: str, stdin=sys.stdin) -> str:
    """The prompt argument, or all of standard input for "-" (a trailing newline dropped)."""
    if arg != "-":
        return arg
    text = stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise ValueError("prompt '-': standard input was empty")
    return text


def cmd_generate(args) -> int:
    sampling_params(args)  # a bad flag is refused before the model loads
    text = read_prompt(args.prompt)  # before the model loads: an empty stdin fails at once
    with make_llm(args) as llm:  # closing saves what --kv-cache-dir still lacks
        params = sampling_params(args, llm.get_default_sampling_params())
        prompt = text
        if not args.raw:
            prompt = llm.apply_chat_template([{"role": "user", "content": text}]) \
                if llm.get_tokenizer().chat_template else text
        for out in llm.stream(prompt, params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    from deepinfer.entrypoints.chat import chat_params, default_history_file, run_chat

    sampling_params(args)  # a bad flag is refused before the model loads
    history_file = default_history_file() if args.history_file is None else args.history_file or None
    with make_llm(args) as llm:
        return run_chat(llm, chat_params(args, llm), system=args.system, history_file=history_file)


def cmd_run(args) -> int:
    """`deepinfer run MODEL [PROMPT]`: the model resolved (pulled if need be), then a chat or one answer."""
    from deepinfer.entrypoints.models_cmd.pull import download_errors
    from deepinfer.entrypoints.run_cmd import resolve_run_model

    try:
        args.model = resolve_run_model(args.run_model)
    except download_errors() as exc:
        print(f"deepinfer: error: pull {args.run_model}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    if args.prompt is None:
        return cmd_chat(args)
    args.raw = False
    return cmd_generate(args)


def cmd_info(args) -> int:
    """Print what the engine builds. With --load-format dummy the weights are shapes only (meta
    tensors): sizes without values, so a wide config needs neither its memory nor a minute.
    With --tensor-parallel-size / --expert-parallel-size above 1, the capacity plan follows; a
    config-only directory gets the plan alone, without building anything."""
    from deepinfer.entrypoints.capacity_report import is_config_only, plan_sizes, print_plan

    if plan_sizes(args) and is_config_only(args):
        print_plan(args)
        return 0
    from deepinfer.entrypoints.info import print_info
    from deepinfer.model_executor.model_loader import shapes_only_dummy_weights

    one_rank = argparse.Namespace(**{**vars(args), "tensor_parallel_size": 1, "expert_parallel_size": 1})
    with shapes_only_dummy_weights(), make_llm(one_rank) as llm:  # the plan, not the engine, splits
        print_info(llm)
        cfg = llm.engine.source.hf_config.to_dict()
    if plan_sizes(args):
        print_plan(args, {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg)
    return 0


def cmd_bench(args) -> int:
    from deepinfer.entrypoints.bench import run_bench

    return run_bench(args)


def cmd_serve(args) -> int:
    from deepinfer.entrypoints.openai.launcher import run_server

    return run_server(args)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, unless its help already says what the default is (or
    there is none to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default == []:
            return text
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: defaults in --help; a bad or unknown flag prints this subcommand's
    one-line usage and the error (exit status 2), not the top-level usage nor every option."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def format_usage(self) -> str:
        names = [a.metavar or a.dest for a in self._actions if not a.option_strings and a.nargs != argparse.PARSER]
        modes = [a for a in self._actions if a.nargs == argparse.PARSER]
        mode = f" [{'|'.join(modes[0].choices)}]" if modes else ""
        return f"usage: {' '.join([self.prog, '[options]', *names])}{mode}  (--help lists the options)\n"

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # argparse would report them from the top-level parser, with its usage
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    from deepinfer.entrypoints.chat import CHAT_MAX_TOKENS
    from deepinfer.entrypoints.engine_args import use_model_defaults

    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: LLM inference engine",
                                     formatter_class=DefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    gen = sub.add_parser("generate", help="stream a completion for PROMPT to stdout")
    gen.add_argument("prompt", help='the prompt; "-" reads it from standard input')
    gen.add_argument("--raw", action="store_true", help="send PROMPT as is (no chat template)")
    chat = sub.add_parser("chat", help="interactive chat with history (the model's chat template)")
    chat.add_argument("--system", default=None, help="system message (/system changes it during the chat)")
    chat.add_argument("--history-file", default=None, metavar="PATH",
                      help="where a terminal session keeps the lines typed, for Up-arrow and Ctrl-R "
                           "(default: ~/.cache/deepinfer/chat_history, or chat_history in $DEEPINFER_CACHE_DIR; "
                           "'' keeps none)")
    from deepinfer.entrypoints.run_cmd import add_run_args

    run = sub.add_parser("run", help="chat with MODEL (pulled first if it is not here), or answer PROMPT "
                                     "(as `ollama run`)")
    add_run_args(run)
    info = sub.add_parser("info", help="architecture, layers, KV bytes per token, cache capacity "
                          "(and the saved cache in --kv-cache-dir)")
    bench = sub.add_parser("bench", help="throughput benchmark (cpu32 and batch-1 decode workloads)")
    from deepinfer.entrypoints.bench import add_bench_args

    add_bench_args(bench)
    from deepinfer.entrypoints.bench import add_bench_serve_parser

    add_bench_serve_parser(bench)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    from deepinfer.entrypoints.openai.args import add_serve_args

    add_serve_args(serve)
    for p, fn in ((gen, cmd_generate), (chat, cmd_chat), (run, cmd_run), (info, cmd_info), (bench, cmd_bench),
                  (serve, cmd_serve)):
        add_engine_args(p)
        if p is not info and p is not serve:
            add_sampling_args(p)
        p.set_defaults(func=fn)
    from deepinfer.entrypoints.capacity_report import add_plan_args

    add_plan_args(info)  # after the engine flags: they may define the parallel sizes already
    # generate and chat: sampling flags left unset mean the model's defaults, as in the server and LLM.generate
    use_model_defaults(gen, 128, "most tokens generated")
    use_model_defaults(chat, CHAT_MAX_TOKENS, "cap on each reply, which also stops at the end of the context")
    use_model_defaults(run, CHAT_MAX_TOKENS, "cap on each reply, which also stops at the end of the context")
    for one_user in (gen, chat, run):  # one request at a time: the KV cache is sized for one, not a server's batch
        next(a for a in one_user._actions if a.dest == "max_num_seqs").default = 1
    bench.set_defaults(max_tokens=None)  # bench: --max-tokens caps the workload's output lengths (None: as drawn)
    from deepinfer.entrypoints.models_cmd import add_model_commands

    add_model_commands(sub)  # pull, list, rm: no engine flags
    return parser


def torchrun_follower(args) -> int | None:
    """Under torchrun a rank > 0 runs no command and prints nothing of its output: for a command that
    builds an engine it serves rank 0's steps until rank 0's engine closes (`worker/torchrun.py`).
    None on rank 0 and without torchrun: run the command."""
    from deepinfer.worker.torchrun import run_follower, torchrun_job

    job = torchrun_job()
    if job is None or job.rank == 0 or getattr(args, "data_parallel_size", 1) > 1:
        return None  # data parallelism: every rank runs `serve` (data_parallel/launch.py)
    if args.func in (cmd_generate, cmd_chat, cmd_bench, cmd_serve):
        job.tensor_parallel_size(args.tensor_parallel_size)  # rank 0's refusal, here too
        run_follower(args.device, job)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a data-parallel front end passes it on
    try:
        follower = torchrun_follower(args)
        return follower if follower is not None else args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status for SIGINT, no traceback
        print("deepinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
