"""`pdserve` command line.

Until the router and worker pools land, `generate` and `chat` run the engine in this process.
"""
from __future__ import annotations

import argparse
import sys
import time


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or an HF directory")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    _engine_args(gen)
    chat = sub.add_parser("chat", help="one chat turn (the model's chat template is applied)")
    chat.add_argument("message")
    chat.add_argument("--system", default=None)
    _engine_args(chat)
    args = parser.parse_args(argv)

    from engine import LLM, SamplingParams
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        t0 = time.perf_counter()
        llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel_size,
                  kv_cache_memory=args.kv_cache_memory)
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        if args.cmd == "generate":
            out = llm.generate(args.prompt, params, use_tqdm=False)[0]
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            out = llm.chat(messages + [{"role": "user", "content": args.message}], params,
                           use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    c = out.outputs[0]
    print(c.text)
    ttft = out.metrics.get("first_token", 0) - out.metrics.get("arrival", 0)
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated, "
          f"finish={c.finish_reason}; load {t_load:.1f}s, TTFT {ttft * 1e3:.0f} ms, "
          f"total {elapsed:.2f}s, {len(c.token_ids) / max(elapsed, 1e-9):.1f} tok/s]", file=sys.stderr)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
