"""The `deepinfer` command: generate, chat, bench, info, serve (each with --help)."""

from __future__ import annotations

import argparse
import sys

from deepinfer.entrypoints.engine_args import add_engine_args, add_sampling_args, make_llm, sampling_params


def cmd_generate(args) -> int:
    params = sampling_params(args)
    with make_llm(args) as llm:  # closing saves what --kv-cache-dir still lacks
        prompt = args.prompt
        if not args.raw:
            prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) \
                if llm.get_tokenizer().chat_template else args.prompt
        for out in llm.stream(prompt, params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    from deepinfer.entrypoints.chat import run_chat

    params = sampling_params(args)
    with make_llm(args) as llm:
        return run_chat(llm, params, system=args.system)


def cmd_info(args) -> int:
    from deepinfer.entrypoints.info import print_info

    with make_llm(args) as llm:
        print_info(llm)
    return 0


def cmd_bench(args) -> int:
    from deepinfer.entrypoints.bench import run_bench

    return run_bench(args)


def cmd_serve(args) -> int:
    from deepinfer.entrypoints.openai.launcher import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion for PROMPT to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send PROMPT as is (no chat template)")
    chat = sub.add_parser("chat", help="interactive chat with history (the model's chat template)")
    chat.add_argument("--system", default=None, help="system message")
    info = sub.add_parser("info", help="architecture, layers, KV bytes per token, cache capacity "
                          "(and the saved cache in --kv-cache-dir)")
    bench = sub.add_parser("bench", help="throughput benchmark (cpu32 and batch-1 decode workloads)")
    from deepinfer.entrypoints.bench import add_bench_args

    add_bench_args(bench)
    from deepinfer.entrypoints.bench_serve import add_bench_serve_parser

    add_bench_serve_parser(bench)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    from deepinfer.entrypoints.openai.args import add_serve_args

    add_serve_args(serve)
    for p, fn in ((gen, cmd_generate), (chat, cmd_chat), (info, cmd_info), (bench, cmd_bench),
                  (serve, cmd_serve)):
        add_engine_args(p)
        if p is not info and p is not serve:
            add_sampling_args(p)
        p.set_defaults(func=fn)
    bench.set_defaults(max_tokens=None)  # bench: --max-tokens caps the workload's output lengths (None: as drawn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status for SIGINT, no traceback
        print("deepinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
