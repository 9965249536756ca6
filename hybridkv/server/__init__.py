"""`hybridkv serve`: an OpenAI-compatible HTTP server over `hybridkv.Engine`
(needs the `server` extra: fastapi, uvicorn, prometheus_client).

    protocol.py     request bodies, OpenAI's error shape, the chat template
    metrics.py      Prometheus metrics
    app.py          the FastAPI app (build_app over one engine, create_app over any engine client)

The thread that owns the engine and the text streams are engine/engine_loop.py
and engine/text_stream.py; the KV event stream is kv_events/.
"""

from __future__ import annotations

import os

from .app import build_app, create_app

__all__ = ["build_app", "create_app", "serve"]

DEFAULT_MODEL = "tiny-gemma3"


def serve(model_dir: str | None = None, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, max_waiting: int = 512, log_level: str = "info",
          kv_events: str | None = None, kv_events_replay: str | None = "next-port", kv_events_topic: str = "",
          max_body_bytes: int | None = None, max_prompt_chars: int | None = None, **engine_options) -> None:
    """Load the model (a Hugging Face folder or a .gguf file) and serve it
    until interrupted. Without `model_dir`, the built-in tiny Gemma-3-style
    model (built on first use, no download). `kv_events`, `max_body_bytes`,
    `max_prompt_chars`: see build_app."""
    import uvicorn

    from ..engine import Engine

    if model_dir is None:
        from ..tiny_models import tiny_model_dir

        model_dir, name = tiny_model_dir(DEFAULT_MODEL), DEFAULT_MODEL
    else:
        name = os.path.basename(os.path.normpath(model_dir)).removesuffix(".gguf")
    if kv_events is not None:
        engine_options["enable_kv_events"] = True
    engine = Engine(model_dir, **engine_options)
    # What the engine chose for this machine, before uvicorn's own lines.
    backend = engine.stats["backend"]
    print(f"hybridkv serve: {name} in {engine.stats['dtype']['weights']} ({engine.stats['dtype']['why']}), "
          f"backend {backend['name']}" + (f", declined: {'; '.join(backend['declined'])}" if backend["declined"] else ""),
          flush=True)
    app = build_app(engine, model_name=served_model_name or name, api_key=api_key, max_waiting=max_waiting,
                    kv_events=kv_events, kv_events_replay=kv_events_replay, kv_events_topic=kv_events_topic,
                    max_body_bytes=max_body_bytes, max_prompt_chars=max_prompt_chars)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
