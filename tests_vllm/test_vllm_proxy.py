"""Prefill and decode on two vLLM servers behind hybridkv's proxy
(hybridkv/integrations/vllm/proxy.py): real `vllm serve` processes, one
with the connector's kv_role "kv_producer", one "kv_consumer", over one
directory. Through the proxy a completion (plain, streamed, chat) gets
the answer vLLM alone gives, with the prompt's blocks loaded from what
the prefill server wrote; with the prefill server gone the decode server
computes the prompt itself and answers the same."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import CONNECTOR

httpx = pytest.importorskip("httpx")

PROMPT = [(7 * i) % 500 + 3 for i in range(200)]  # 6 whole blocks of 32
CLOSE = 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    def __init__(self, model: str, directory: str, logs: str):
        self.model, self.logs, self.procs = model, logs, {}
        self.urls = {name: f"http://127.0.0.1:{free_port()}" for name in ("prefill", "decode", "proxy")}
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            transfer = dict(CONNECTOR, kv_role=role, kv_connector_extra_config={"disk_dir": directory})
            self.start(name, ["-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
                              "--max-model-len", "1024", "--enable-prefix-caching", "--block-size", "32",
                              "--enforce-eager", "--max-num-seqs", "8", "--seed", "0",
                              "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer)])
        self.start("proxy", ["-m", "hybridkv.integrations.vllm.proxy", "--prefill", self.urls["prefill"],
                             "--decode", self.urls["decode"]])
        for name in self.procs:
            self.wait(name)

    def start(self, name: str, args: list[str]) -> None:
        port = self.urls[name].rsplit(":", 1)[1]
        args = args + ["--port", port] + (["--host", "127.0.0.1"] if name != "proxy" else [])
        log = open(os.path.join(self.logs, f"{name}.log"), "w")
        self.procs[name] = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT)

    def wait(self, name: str, seconds: float = 300) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                break
            try:
                if httpx.get(self.urls[name] + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        with open(os.path.join(self.logs, f"{name}.log")) as f:
            pytest.fail(f"the {name} server did not start:\n{f.read()[-3000:]}")

    def post(self, name: str, path: str, body: dict) -> dict:
        answer = httpx.post(self.urls[name] + path, json=dict(body, model=self.model), timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)


@pytest.fixture(scope="module")
def servers(tiny_gemma3, tmp_path_factory):
    made = Servers(tiny_gemma3, str(tmp_path_factory.mktemp("kv")), str(tmp_path_factory.mktemp("logs")))
    yield made
    made.close()


def completion(prompt, **extra) -> dict:
    return dict(prompt=prompt, max_tokens=8, temperature=0, logprobs=3, **extra)


def same_answer(got: dict, expected: dict) -> None:
    a, b = got["choices"][0], expected["choices"][0]
    assert a["text"] == b["text"]
    if "logprobs" in a and a["logprobs"] and "token_logprobs" in a["logprobs"]:
        for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True):
            assert abs(x - y) < CLOSE


def test_a_completion_through_the_proxy_takes_its_prompt_from_the_prefill_server(servers):
    proxied = servers.post("proxy", "/v1/completions", completion(PROMPT))
    # every whole block but the last token's, from the prefill server's files
    assert proxied["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    alone = servers.post("prefill", "/v1/completions", completion(PROMPT))  # vLLM alone (its pool is exact)
    same_answer(proxied, alone)
    counts = httpx.get(servers.urls["proxy"] + "/health").json()
    assert counts["prefilled"] >= 1 and counts["prefill_failed"] == 0


def test_streamed_and_chat_completions_pass_through(servers):
    prompt = [(11 * i) % 400 + 5 for i in range(150)]
    body = completion(prompt, stream=True)
    text = ""
    with httpx.stream("POST", servers.urls["proxy"] + "/v1/completions", json=dict(body, model=servers.model),
                      timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c.get("text", "") for c in json.loads(line[6:])["choices"])
    alone = servers.post("prefill", "/v1/completions", completion(prompt))
    assert text == alone["choices"][0]["text"]
    chat = dict(messages=[{"role": "user", "content": "tell me about the body " * 20}], max_tokens=6, temperature=0)
    proxied = servers.post("proxy", "/v1/chat/completions", chat)
    assert proxied["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    alone = servers.post("prefill", "/v1/chat/completions", chat)
    assert proxied["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_without_the_prefill_server_the_decode_server_computes_the_prompt(servers):
    prompt = [(13 * i) % 450 + 7 for i in range(180)]
    expected = servers.post("decode", "/v1/completions", completion(prompt, cache_salt="first"))
    servers.stop("prefill")
    # another salt: nothing of this prompt in the decode server's pool or on disk
    proxied = servers.post("proxy", "/v1/completions", completion(prompt, cache_salt="second"))
    assert proxied["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    same_answer(proxied, expected)
    assert httpx.get(servers.urls["proxy"] + "/health").json()["prefill_failed"] == 1
