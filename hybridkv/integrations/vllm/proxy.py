"""Prefill and decode on two vLLM servers, behind one OpenAI-compatible
address: each completion goes first to a prefill server (vLLM with the
connector's kv_role "kv_producer") for one token, which writes the
prompt's blocks to the shared directory in the step that computes them,
then to a decode server ("kv_consumer"), which finds them there and loads
them as a tier hit, and answers (streamed or not) as vLLM alone would.

A prefill server that is down or fails only costs time: the decode server
computes the prompt itself (its tokens are the same either way). Several
servers of a role take requests in turn.

    python -m hybridkv.integrations.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Needs fastapi, uvicorn and httpx (vLLM's own requirements bring them).
"""


import argparse
import contextlib
import itertools
import logging

log = logging.getLogger("hybridkv.proxy")

# Fields of a completion request that only the decode side's answer needs.
_ANSWER_ONLY = ("stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "best_of", "logprobs",
                "top_logprobs", "echo", "min_tokens")


def prefill_body(body: dict, chat: bool) -> dict:
    """The request the prefill server gets: the same prompt and settings
    (its blocks' keys: the same tokens, salt and model), one token, no
    stream."""
    out = {k: v for k, v in body.items() if k not in _ANSWER_ONLY}
    out["max_completion_tokens" if chat else "max_tokens"] = 1
    out["stream"] = False
    return out


def build_app(prefill: list[str], decode: list[str], timeout: float | None = None):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode server")
    client = httpx.AsyncClient(timeout=timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    app = FastAPI(title="hybridkv prefill/decode proxy", lifespan=lifespan)
    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)
    app.state.counts = {"prefilled": 0, "prefill_failed": 0, "decoded": 0}

    async def prefilled(path: str, body: dict, chat: bool) -> None:
        url = next(prefills) + path
        try:
            answer = await client.post(url, json=prefill_body(body, chat))
        except httpx.HTTPError as error:
            log.warning("prefill at %s failed (%s): the decode server computes the prompt", url, error)
            app.state.counts["prefill_failed"] += 1
            return
        if answer.status_code != 200:
            log.warning("prefill at %s answered %s: the decode server computes the prompt", url, answer.status_code)
            app.state.counts["prefill_failed"] += 1
            return
        app.state.counts["prefilled"] += 1

    async def forward(path: str, request: Request, chat: bool):
        body = await request.json()
        await prefilled(path, body, chat)
        url = next(decodes) + path
        app.state.counts["decoded"] += 1
        if not body.get("stream"):
            answer = await client.post(url, json=body)
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
        upstream = await client.send(client.build_request("POST", url, json=body), stream=True)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type"))

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type=upstream.headers.get("content-type", "text/event-stream"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward("/v1/completions", request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward("/v1/chat/completions", request, chat=True)

    @app.get("/v1/models")
    async def models():
        answer = await client.get(next(decodes) + "/v1/models")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        """200 where every decode server answers its /health (a prefill
        server down only costs time)."""
        down = []
        for url in decode:
            try:
                if (await client.get(url + "/health")).status_code != 200:
                    down.append(url)
            except httpx.HTTPError:
                down.append(url)
        return JSONResponse({"decode_down": down, **app.state.counts}, status_code=503 if down else 200)

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.integrations.vllm.proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", action="append", required=True, help="a prefill (kv_producer) server's URL")
    parser.add_argument("--decode", action="append", required=True, help="a decode (kv_consumer) server's URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    strip = lambda urls: [u.rstrip("/") for u in urls]  # noqa: E731
    uvicorn.run(build_app(strip(args.prefill), strip(args.decode)), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
