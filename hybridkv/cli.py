"""The `hybridkv` command: plan | demo | serve | build-kernels."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from .tiny_models import MODELS as TINY_MODELS

CONTEXTS = (1024, 8192, 32768, 131072)


def kv_cache_dtype_option(text: str | None):
    """`--kv-cache-dtype`: one dtype ("int8", "auto"), or kind=dtype pairs
    ("full_attention=int8,sliding_window=auto")."""
    if text is None or "=" not in text:
        return text
    pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"--kv-cache-dtype: expected DTYPE or KIND=DTYPE,KIND=DTYPE, got {text!r}")
    return {kind.strip(): dtype.strip() for kind, dtype in pairs}


def _plan(args) -> int:
    from .core.hf_config import load_config, specs_from_config
    from .core.layout import parse_memory, plan_layout
    from .core.specs import with_kv_cache_dtype

    config = load_config(args.config)
    specs = specs_from_config(config, dtype=args.dtype, state_dtype=args.recurrent_state_dtype)
    specs = with_kv_cache_dtype(specs, kv_cache_dtype_option(args.kv_cache_dtype))
    layout = plan_layout(specs, parse_memory(args.memory), block_size=args.block_size)
    print(f"{args.config}: {len(specs)} layers with a cache, {len(layout.groups)} group(s)")
    print(layout.describe())
    waste = layout.static_waste_bytes
    print(f"static waste: {waste:,} B ({100 * waste / layout.memory_bytes:.4f}% of the budget: "
          f"the null page and the remainder under one page)")
    print(f"\n{'context':>8} {'pages/request':>14} {'requests that fit':>18}")
    for context in CONTEXTS:
        print(f"{context:>8} {layout.pages_per_request(context):>14,} {layout.max_requests(context):>18,}")
    if args.plot:
        from .plot import plot_layout

        plot_layout(layout, args.config, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


def _demo(args) -> int:
    from .demo import main as demo_main

    demo_main(tiny=args.tiny or bool(args.model), num_requests=args.requests, max_tokens=args.max_tokens,
              progress=not args.no_progress, models=args.model)
    return 0


def _serve(args) -> int:
    # From here on a SIGTERM stops the command as Ctrl-C does, before Ray
    # or the model start too: what started is stopped (serving/ray.py stops
    # a local Ray with every process of it, uvicorn drains the requests),
    # and a stop that was asked for exits 0, as process managers expect.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _serve_until_stopped(args)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)  # main() may run inside another program (tests)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _serve_until_stopped(args) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be a port number, 0 to 65535, got {args.port}")
    if args.prefill_replicas and args.replicas is None and args.address is None:
        raise ValueError("--prefill-replicas goes with --replicas N (the decode replicas)")
    if args.replicas is not None or args.address is not None:
        if args.kv_events:
            raise ValueError("--kv-events publishes one engine's events; with --replicas the router reads "
                             "them through Ray (docs/server.md)")
        return _serve_replicas(args)
    engine_options = _engine_options(args)
    try:
        from .server import serve
    except ImportError as e:
        print(f"hybridkv serve: error: {e}; install the server extra: pip install 'hybridkv[server]'",
              file=sys.stderr)
        return 2
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.model and args.model_option and args.model != args.model_option:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_option!r}")
    replay = None if args.kv_events_replay == "none" else args.kv_events_replay
    serve(args.model or args.model_option, host=args.host, port=args.port, api_key=args.api_key,
          served_model_name=args.served_model_name, max_waiting=args.max_waiting, log_level=args.log_level,
          kv_events=args.kv_events, kv_events_replay=replay, kv_events_topic=args.kv_events_topic,
          **_limits(args), **engine_options)
    return 0


def _build_kernels(args) -> int:
    """Compile hybridkv's C libraries for this machine (an install where a
    compiler was found did it already): the cpu backend's kernels and the
    block-key chain."""
    from .core.native import LIBRARIES

    failed = 0
    for library in LIBRARIES:
        try:
            path = library.build_into(library.cache_dir()) if args.cache else library.build()
        except (RuntimeError, OSError) as e:
            print(f"hybridkv build-kernels: error: {library.source.name}: {e}", file=sys.stderr)
            failed = 1
            continue
        print(f"built {path}")
    return failed


def _limits(args) -> dict:
    """--max-body-bytes and --max-prompt-chars (None: the server's defaults)."""
    from .core.layout import parse_memory

    if args.max_prompt_chars is not None and args.max_prompt_chars <= 0:
        raise ValueError(f"--max-prompt-chars must be positive, got {args.max_prompt_chars}")
    body = parse_memory(args.max_body_bytes) if args.max_body_bytes is not None else None
    return {"max_body_bytes": body, "max_prompt_chars": args.max_prompt_chars}


def _engine_options(args) -> dict:
    """The engine options the command line gives, checked here (EngineConfig)
    before a server or a Ray cluster starts: `Engine(model, **options)`."""
    from .engine.config import EngineConfig

    options = dict(
        backend=args.backend, kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
        kv_cache_dtype=kv_cache_dtype_option(args.kv_cache_dtype), recurrent_state_dtype=args.recurrent_state_dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching, dtype=args.dtype,
        device=args.device, speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens, kv_host_cache_memory=args.kv_host_cache_memory,
        kv_disk_cache=args.kv_disk_cache, kv_disk_cache_memory=args.kv_disk_cache_memory, kv_role=args.kv_role,
        tensor_parallel_size=args.tensor_parallel_size, tensor_parallel_timeout=args.tensor_parallel_timeout,
        tensor_parallel_heartbeat_timeout=args.tensor_parallel_heartbeat_timeout, seed=args.seed)
    config = EngineConfig(args.model or args.model_option or "tiny-gemma3", **options)  # the servers' default model
    if args.address is None:  # the engines run on this machine (on a cluster's nodes each Engine checks its own)
        config.check_machine()
    return options


def _serve_replicas(args) -> int:
    """`--replicas N`: N engines on Ray Serve (hybridkv/serving/ray.py)."""
    engine_options = _engine_options(args)
    try:
        from .serving.ray import serve_replicas
    except ImportError as e:
        print(f"hybridkv serve: error: {e}; --replicas needs the ray and server extras: "
              f"pip install 'hybridkv[server,ray]'", file=sys.stderr)
        return 2
    replicas = 1 if args.replicas is None else args.replicas
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if args.prefill_replicas < 0 or (args.prefill_replicas and not args.kv_disk_cache):
        raise ValueError("--prefill-replicas must be >= 0, and needs --kv-disk-cache (the directory prefill and "
                         "decode replicas share)")
    model = args.model or args.model_option
    if model is None:
        from .tiny_models import tiny_model_dir

        model, name = tiny_model_dir("tiny-gemma3"), "tiny-gemma3"
    else:
        name = os.path.basename(os.path.normpath(model)).removesuffix(".gguf")
    serve_replicas(model, model_name=args.served_model_name or name, num_replicas=replicas, address=args.address,
                   host=args.host, port=args.port, api_key=args.api_key, max_waiting=args.max_waiting,
                   engine_options=engine_options, prefill_replicas=args.prefill_replicas,
                   local_prefill_tokens=args.local_prefill_tokens, **_limits(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="plan the KV cache layout of a model config")
    plan.add_argument("config", help="a config.json file (see models/) or a model folder")
    plan.add_argument("--memory", default="80GiB", help="KV cache budget, e.g. 80GiB (default)")
    plan.add_argument("--block-size", type=int, default=None,
                      help="tokens per block (default: the planner's, 16, or 64 with recurrent layers)")
    plan.add_argument("--dtype", default=None, help="the model's dtype (default: the config's)")
    plan.add_argument("--kv-cache-dtype", default=None, metavar="DTYPE",
                      help="attention pages: auto (the model's dtype), int8, fp8_e4m3, fp8_e5m2, bfloat16, ..., "
                           "or per kind: full_attention=int8,sliding_window=auto")
    plan.add_argument("--recurrent-state-dtype", default="float32", choices=("float32", "bfloat16"),
                      help="recurrent states (default float32; never quantized)")
    plan.add_argument("--plot", default=None, metavar="PNG", help="also draw the layout (needs matplotlib)")
    plan.set_defaults(func=_plan)

    demo = sub.add_parser("demo", help="serve a batch of questions on the real Gemma-3 270M (or --tiny models)")
    demo.add_argument("--tiny", action="store_true",
                      help="the built-in tiny Gemma-3, Jamba and gpt-oss models (random weights) instead of the real "
                           "model")
    demo.add_argument("--model", action="append", choices=sorted(n for n in TINY_MODELS if n.startswith("tiny-")),
                      help="with --tiny: this built-in model (repeatable; default tiny-gemma3, tiny-jamba and "
                           "tiny-gpt-oss)")
    demo.add_argument("--requests", type=int, default=32, help="requests per tiny model (default 32)")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(func=_demo)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (docs/server.md)")
    serve.add_argument("model", nargs="?", default=None,
                       help="a Hugging Face model folder or a .gguf file (default: the built-in tiny-gemma3)")
    serve.add_argument("--model", dest="model_option", default=None, metavar="PATH",
                       help="the same, as an option: a model folder or a .gguf file")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=os.environ.get("HYBRIDKV_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 (default: $HYBRIDKV_API_KEY, else none)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients use (default: the folder's name)")
    serve.add_argument("--max-waiting", type=int, default=512,
                       help="answer 503 while this many requests wait for admission (default 512)")
    serve.add_argument("--max-body-bytes", default=None, metavar="BYTES",
                       help="answer 413 to larger request bodies, before reading them (default: room for the "
                            "longest prompt that can fit the context, plus 1MiB)")
    serve.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                       help="answer 400 to longer text prompts, before tokenizing them (default: the context "
                            "times the longest token's characters)")
    serve.add_argument("--kv-cache-memory", default="2GiB", help="KV cache budget, e.g. 2GiB (default) or auto")
    serve.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                       help="attention pages: auto (default: the model's dtype), int8, fp8_e4m3, fp8_e5m2, ..., "
                            "or per kind: full_attention=int8,sliding_window=auto")
    serve.add_argument("--recurrent-state-dtype", default="float32", choices=("float32", "bfloat16"),
                       help="recurrent states (default float32; never quantized)")
    serve.add_argument("--block-size", type=int, default=None,
                       help="tokens per block (default: the planner's, 16, or 64 with recurrent layers)")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step (default 64)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tokens per step (default 1024)")
    serve.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    serve.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    serve.add_argument("--kv-host-cache-memory", default=None, metavar="BYTES",
                       help="keep blocks the KV pool evicts in host memory, e.g. 4GiB (default: off)")
    serve.add_argument("--kv-disk-cache", default=None, metavar="DIR",
                       help="keep evicted blocks in files under DIR; a restarted server hits them (default: off)")
    serve.add_argument("--kv-disk-cache-memory", default="16GiB", metavar="BYTES",
                       help="byte budget of the disk tier (default 16GiB)")
    serve.add_argument("--kv-role", choices=["prefill", "decode"], default=None,
                       help="prefill and decode on different servers over one --kv-disk-cache both read: "
                            "prefill leaves each prompt's hit there, decode loads it (default: neither)")
    serve.add_argument("--speculative-method", choices=["ngram"], default=None,
                       help="speculative decoding: ngram (prompt-lookup drafts; greedy outputs unchanged)")
    serve.add_argument("--num-speculative-tokens", type=int, default=4,
                       help="draft tokens verified per step with --speculative-method (default 4)")
    serve.add_argument("--dtype", default=None,
                       help="weights dtype: auto, bfloat16, float16, float32 (default: $HYBRIDKV_DTYPE, else auto: "
                            "on a CPU bfloat16 where it computes it natively, else float32; on a GPU the checkpoint's)")
    serve.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    serve.add_argument("--backend", default=None,
                       help="the implementation of a step's ops: auto, torch, cpu, triton, flashinfer or "
                            "triton+flashinfer (default: $HYBRIDKV_BACKEND, else auto; docs/kernels.md)")
    serve.add_argument("--seed", type=int, default=None,
                       help="draws of requests that send no seed: fresh at each start (default), or this "
                            "64-bit integer's, for reproducible runs")
    serve.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="split the model over N processes, one KV cache manager (docs/engine.md; default 1)")
    serve.add_argument("--tensor-parallel-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="with --tensor-parallel-size: how long a collective (and the start) waits for the "
                            "other ranks before it fails (default 600)")
    serve.add_argument("--tensor-parallel-heartbeat-timeout", type=float, default=5.0, metavar="SECONDS",
                       help="with --tensor-parallel-size: a worker silent this long counts as hung; the engine "
                            "then fails and /health answers 503 (default 5)")
    serve.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                       help="publish the KV cache events on a ZMQ PUB socket bound there, in vLLM's KV event "
                            "format (e.g. tcp://*:5557; needs pyzmq and msgspec, in the server extra)")
    serve.add_argument("--kv-events-replay", default="next-port", metavar="tcp://HOST:PORT",
                       help="the replay socket that resends missed batches (default: the --kv-events port + 1; "
                            "'none' for no replay)")
    serve.add_argument("--kv-events-topic", default="", help="the topic of every event message (default empty)")
    serve.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="N engine replicas on Ray Serve, routed by prefix hit (docs/server.md; needs .[ray])")
    serve.add_argument("--prefill-replicas", type=int, default=0, metavar="P",
                       help="with --replicas N: P prefill replicas before the N decode ones, meeting in "
                            "--kv-disk-cache (default 0: every replica does both)")
    serve.add_argument("--local-prefill-tokens", type=int, default=64, metavar="T",
                       help="with --prefill-replicas: a prompt whose part past the decode replicas' best hit is at "
                            "most T tokens is computed by the decode replica, with no transfer (default 64)")
    serve.add_argument("--address", default=None, metavar="RAY_ADDRESS",
                       help="with --replicas: join this Ray cluster (default: start a local Ray)")
    serve.set_defaults(func=_serve)

    kernels = sub.add_parser("build-kernels", help="compile the cpu backend's C kernels and the block-key chain "
                                                   "for this machine")
    kernels.add_argument("--cache", action="store_true",
                         help="into the cache folder (~/.cache/hybridkv/cpu-kernels, .../hash-chain) even if the "
                              "package folder is writable")
    kernels.set_defaults(func=_build_kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"hybridkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
