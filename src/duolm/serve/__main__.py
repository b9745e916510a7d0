"""python -m duolm.serve MODEL [--host] [--port] [--api-key | --api-key-file] [--max-concurrency] [--max-queue]"""
import argparse
import sys

from duolm.serve import read_api_key, run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="duolm serve", description="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", help="model directory (duolm, Hugging Face, or a training run)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (visible in ps; prefer --api-key-file)")
    key.add_argument("--api-key-file", help="file holding the API key")
    p.add_argument("--max-concurrency", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond that before 429 (default 64)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--model-name", help="model id clients use (default: the directory's name)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    try:
        api_key = read_api_key(args.api_key_file) if args.api_key_file else args.api_key
        run(args.model, args.host, args.port, api_key=api_key, max_concurrency=args.max_concurrency,
            max_queue=args.max_queue, drain_timeout=args.drain_timeout, model_name=args.model_name,
            device=args.device)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"duolm serve: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
