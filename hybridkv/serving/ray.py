"""N engine replicas as a Ray Serve application behind the same OpenAI API
as `hybridkv serve` (needs the `ray` and `server` extras).

    OpenAIIngress   FastAPI (hybridkv.server.create_app): parses, applies the
                    chat template, tokenizes, and calls the engine replicas
                    with token ids through a deployment handle
    EngineReplica   one Engine (KV events on) behind an EngineLoop; streams
                    Updates; reports its KV events and counters to the routers
    HybridPrefixRouter (ray_router.py) picks the replica for each call
    PrefillReplica  (with `prefill_replicas`) engines of kv_role "prefill":
                    the ingress sends each prompt there first (one token),
                    and the EngineReplicas, of kv_role "decode", load what
                    it left in the directory both share (`kv_disk_cache`)

The ingress tokenizes so that the router, which runs inside the ingress's
process, sees token ids and can compute each replica's hit.

A replica that dies (killed, out of memory, its node lost) is restarted by
Ray Serve. A request that was on it is retried on another replica when
nothing of it has reached the client yet: every non-streamed request, and a
streamed one before its first token. A stream that already sent text ends
with an error event (HTTP 503 type, code `replica_failed`): the client
retries it. `retries` bounds the attempts per request. A prefill replica
that fails (or refuses) costs nothing but time: the decode replica then
computes the whole prompt itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from dataclasses import dataclass

import ray
from prometheus_client import Counter, Gauge
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig

from ..engine import Engine
from ..modeling.loader import load_tokenizer, resolve_model_dir
from ..server.app import create_app
from ..engine.engine_loop import EngineFailed, EngineLoop, Overloaded, Update
from ..server.metrics import ServerMetrics
from ..server.protocol import APIError
from ..kv_events.feed import EventReporter
from .processes import end_processes, processes_below
from .ray_router import HybridPrefixRouter, replica_stats, router_of

APP_NAME = "hybridkv"
REPLICA_HEADER = "x-hybridkv-replica"
# What a caller sees when the replica it was talking to went away.
_REPLICA_GONE = (RayActorError, ActorUnavailableError)


@dataclass
class Refused:
    """A replica's answer to a request it could not take (or finish)."""
    kind: str  # "bad_request", "overloaded", "engine_failed"
    message: str

    def error(self) -> Exception:
        return {"bad_request": ValueError, "overloaded": Overloaded}.get(self.kind, EngineFailed)(self.message)


class EngineReplica:
    """One engine. Ray Serve calls `record_routing_stats` every stats period
    (its answer reaches the routers) and `check_health` (a failed engine is
    replaced)."""

    async def __init__(self, model_dir: str, engine_options: dict, max_waiting: int = 512,
                       snapshot_every: int = 20):
        self.engine = Engine(model_dir, enable_kv_events=True, **engine_options)
        self.loop = EngineLoop(self.engine, max_waiting=max_waiting)
        self.loop.start()  # on Serve's user event loop, where every method below runs
        self.reporter = EventReporter(snapshot_every)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def describe(self) -> dict:
        return {"replica": self.replica_id, "max_model_len": self.engine.max_model_len}

    async def generate(self, *, token_ids: list[int], params, request_id: str, cache_salt: str | None = None):
        """First `{"replica": id}` (or a Refused), then the request's Updates."""
        try:
            stream = await self.loop.submit(token_ids, params, request_id, cache_salt=cache_salt)
        except ValueError as e:
            yield Refused("bad_request", str(e))
            return
        except Overloaded as e:
            yield Refused("overloaded", str(e))
            return
        except EngineFailed as e:
            yield Refused("engine_failed", str(e))
            return
        yield {"replica": self.replica_id}
        try:
            async for update in stream:
                yield update
        except EngineFailed as e:
            yield Refused("engine_failed", str(e))
        finally:
            stream.abort()  # the caller went away (Serve cancels this generator) or it finished: a no-op

    async def record_routing_stats(self) -> dict:
        def report(engine):
            return {"kv_events": self.reporter.report(engine.kv), "engine": self.loop.snapshot(engine)}

        return await self.loop.call(report)

    async def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError(f"the engine loop is not running: {self.loop.error}")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()
            self.engine.close()


class ReplicaCall:
    """One request on the replicas: an async iterator of Updates with
    `abort()` and `headers`, as create_app expects of an engine client's stream.
    Retries on another replica while nothing has reached the client."""

    def __init__(self, replicas: "ReplicaSet", kwargs: dict, buffered: bool):
        self.replicas = replicas
        self.kwargs = kwargs
        self.buffered = buffered  # collect the whole answer before handing any of it out
        self.headers: dict[str, str] = {}
        self.attempts = 0
        self._gen = None
        self._buffer: list[Update] = []
        self._handed_out = False
        self._started = time.monotonic()
        self._ttft_seen = False

    async def open(self) -> "ReplicaCall":
        while True:
            try:
                await self._attempt()
                return self
            except _REPLICA_GONE as e:
                self._retry_or_fail(e)

    def _retry_or_fail(self, error: Exception) -> None:
        """Called with the replica's failure; returns if another attempt may be made."""
        if self.attempts <= self.replicas.retries:
            self.replicas.retried.inc()
            return
        raise APIError(503, f"the engine replica serving this request failed ({type(error).__name__}) and "
                       f"{self.attempts} attempts were made; retry the request", "server_error",
                       code="replica_failed") from None

    async def _attempt(self) -> None:
        self.attempts += 1
        self._gen = self.replicas.handle.options(stream=True).generate.remote(**self.kwargs)
        first = await self._gen.__anext__()
        if isinstance(first, Refused):
            raise first.error()
        self.headers = {REPLICA_HEADER: first["replica"]}
        if self.buffered:
            self._buffer = []
            async for item in self._gen:
                if isinstance(item, Refused):
                    raise item.error()
                self._see(item)
                self._buffer.append(item)
            self._buffer.reverse()  # popped from the end

    def _see(self, update: Update) -> None:
        if not self._ttft_seen and any(d.text for d in update.deltas):
            self._ttft_seen = True
            self.replicas.server_metrics.ttft.observe(time.monotonic() - self._started)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self.buffered:
            if not self._buffer:
                raise StopAsyncIteration
            return self._buffer.pop()
        while True:
            try:
                item = await self._gen.__anext__()
                break
            except _REPLICA_GONE as e:
                if self._handed_out:
                    raise APIError(503, "the engine replica serving this stream failed after it began; retry the "
                                   "request", "server_error", code="replica_failed") from None
                self._retry_or_fail(e)
                await self.open()
        if isinstance(item, Refused):
            raise item.error()
        self._handed_out = True
        self._see(item)
        return item

    def abort(self) -> None:
        if self._gen is not None:
            self._gen.cancel()  # the replica's generator is cancelled, and its request aborted


class ReplicaSet:
    """create_app's engine client over the engine deployment's handle."""

    def __init__(self, handle, tokenizer, retries: int, prefill=None, local_prefill_tokens: int = 0):
        self.handle = handle
        self.prefill = prefill  # the prefill replicas' handle, or None
        # A prompt whose part past the decode replicas' best hit is at most
        # this many tokens is computed by the decode replica (no transfer).
        self.local_prefill_tokens = local_prefill_tokens
        self.tokenizer = tokenizer
        self.retries = retries
        self.server_metrics = ServerMetrics()
        self.retried = Counter("hybridkv_requests_retried", "Requests sent again to another replica because the "
                               "one serving them failed before any of their output reached the client",
                               registry=self.server_metrics.registry)
        self.prefills = Counter("hybridkv_prefills", "Prompts computed by a prefill replica, by outcome (done; "
                                "failed: the decode replica computed the prompt itself; local: the part past a "
                                "decode replica's hit was short enough to compute there)", labelnames=["outcome"],
                                registry=self.server_metrics.registry)
        # What the router of the engine deployment knows of its replicas'
        # caches (set at each scrape): a router that lost track of a replica
        # routes to it by queue length alone until its next snapshot.
        self.router_synced = Gauge("hybridkv_router_replica_synced", "1 where this process's router follows the "
                                   "replica's cached blocks exactly, 0 where it lost its reports until the next "
                                   "snapshot", labelnames=["replica"], registry=self.server_metrics.registry)
        self.router_gaps = Gauge("hybridkv_router_report_gaps", "Times this process's router missed more of a "
                                 "replica's reports than the next one's backlog held",
                                 registry=self.server_metrics.registry)
        self.max_model_len = None
        self.alive = True  # Ray Serve health-checks and replaces the replicas themselves
        self.error = None

    async def start(self) -> None:
        # One call through the handle: it starts this process's router, so
        # replica stats flow before the first request.
        self.max_model_len = (await self.handle.describe.remote())["max_model_len"]

    async def stop(self) -> None:
        pass

    async def submit(self, token_ids: list[int], params, request_id: str, *, stream: bool = False,
                     cache_salt=None) -> ReplicaCall:
        if not token_ids:
            raise ValueError("empty prompt: a request needs at least one token")
        kwargs = dict(token_ids=list(token_ids), params=params, request_id=request_id, cache_salt=cache_salt)
        if self.prefill is not None and params.prompt_logprobs is None:
            if len(token_ids) - self._decode_hit(token_ids, cache_salt) <= self.local_prefill_tokens:
                self.prefills.labels("local").inc()
            else:
                await self._prefill(kwargs)
        return await ReplicaCall(self, kwargs, buffered=not stream).open()

    def _decode_hit(self, token_ids: list[int], cache_salt) -> int:
        """The longest hit on the prompt a decode replica holds (0 where the
        handle's router is not the hybrid one)."""
        deployment = self.handle.deployment_id
        router = router_of(deployment.app_name, deployment.name)
        return router.best_hit(token_ids, cache_salt) if router is not None else 0

    async def _prefill(self, kwargs: dict) -> None:
        """The prompt on a prefill replica, one token long: it leaves the
        blocks a hit of the prompt reads where the decode replicas look.
        Whatever goes wrong there, the decode replica computes the prompt."""
        one = dataclasses.replace(kwargs["params"], n=1, max_tokens=1)
        try:
            call = self.prefill.options(stream=True).generate.remote(**dict(
                kwargs, params=one, request_id=f"{kwargs['request_id']}:prefill"))
            async for item in call:
                if isinstance(item, Refused):
                    raise item.error()
        except Exception:  # (a refusal, a replica gone: the decode side recomputes, never wrong tokens)
            self.prefills.labels("failed").inc()
            return
        self.prefills.labels("done").inc()

    async def metrics(self) -> bytes:
        deployment = self.handle.deployment_id
        stats = replica_stats().get((deployment.app_name, deployment.name), {})
        router = router_of(deployment.app_name, deployment.name)
        if router is not None:
            self.router_gaps.set(router.feed.num_gaps)
            self.router_synced.clear()  # (replicas gone since the last scrape leave no line)
            for replica in stats:
                self.router_synced.labels(replica).set(int(router.feed.synced(replica)))
        return self.server_metrics.render_replicas(stats)


@serve.ingress()
class OpenAIIngress:
    async def __init__(self, engine_handle, model_dir: str, model_name: str, api_key: str | None = None,
                       retries: int = 2, limits: dict | None = None, prefill_handle=None,
                       local_prefill_tokens: int = 0):
        tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model_dir(model_dir, progress=False))
        self.engine_client = ReplicaSet(engine_handle, tokenizer, retries, prefill_handle, local_prefill_tokens)
        self.model_name, self.api_key, self.limits = model_name, api_key, limits or {}

    def __serve_build_asgi_app__(self):
        return create_app(self.engine_client, model_name=self.model_name, api_key=self.api_key, **self.limits)


def build_application(model_dir: str, *, model_name: str, num_replicas: int = 2, engine_options: dict | None = None,
                      api_key: str | None = None, router: str = "hybrid", queued_request_tokens: int = 256,
                      stats_period_s: float = 1.0, snapshot_every: int = 20, replica_cpus: float = 1.0,
                      max_ongoing_requests: int = 256, max_waiting: int = 512, health_check_period_s: float = 5.0,
                      retries: int = 2, max_body_bytes: int | None = None, max_prompt_chars: int | None = None,
                      prefill_replicas: int = 0, local_prefill_tokens: int = 64):
    """The Ray Serve application: `serve.run(build_application(...))`.
    `router`: "hybrid" (HybridPrefixRouter) or "default" (Ray's
    power-of-two-choices, for comparison). `replica_cpus`: what a replica
    asks of Ray per process (tensor parallelism: per rank). `max_body_bytes`,
    `max_prompt_chars`: the ingress's bounds (hybridkv.server.create_app).
    `prefill_replicas`: that many prefill replicas before the
    `num_replicas` decode ones (engine_options must name the
    `kv_disk_cache` directory they share); a prompt whose part past the
    decode replicas' best hit is at most `local_prefill_tokens` is computed
    by the decode replica (a short prompt, or one a decode replica holds)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if prefill_replicas < 0:
        raise ValueError(f"prefill_replicas must be >= 0, got {prefill_replicas}")
    if local_prefill_tokens < 0:
        raise ValueError(f"local_prefill_tokens must be >= 0, got {local_prefill_tokens}")
    engine_options = dict(engine_options or {})
    if prefill_replicas and not engine_options.get("kv_disk_cache"):
        raise ValueError("prefill replicas need kv_disk_cache: the directory the prefill and decode replicas "
                         "share (on one machine, one under /dev/shm is shared memory)")
    if router not in ("hybrid", "default"):
        raise ValueError(f"router must be 'hybrid' or 'default', got {router!r}")
    router_config = RequestRouterConfig(request_routing_stats_period_s=stats_period_s)
    if router == "hybrid":
        router_config = RequestRouterConfig(request_router_class=HybridPrefixRouter,
                                            request_router_kwargs={"queued_request_tokens": queued_request_tokens,
                                                                   "recent_horizon_s": 5 * stats_period_s + 1.0},
                                            request_routing_stats_period_s=stats_period_s)
    def engines(name: str, count: int, role: str | None):
        options = dict(engine_options, kv_role=role) if role else engine_options
        return serve.deployment(EngineReplica, name=name).options(
            num_replicas=count, max_ongoing_requests=max_ongoing_requests,
            ray_actor_options={"num_cpus": replica_cpus * _ranks(engine_options)},
            request_router_config=router_config, health_check_period_s=health_check_period_s,
            health_check_timeout_s=max(30.0, health_check_period_s)).bind(model_dir, options, max_waiting,
                                                                          snapshot_every)

    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=1, max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
    limits = {"max_body_bytes": max_body_bytes, "max_prompt_chars": max_prompt_chars}
    prefill = engines("PrefillReplica", prefill_replicas, "prefill") if prefill_replicas else None
    decode = engines("EngineReplica", num_replicas, "decode" if prefill_replicas else None)
    return ingress.bind(decode, model_dir, model_name, api_key, retries, limits, prefill, local_prefill_tokens)


def _ranks(engine_options: dict | None) -> int:
    """The processes of one replica: its engine, and with tensor parallelism
    the workers the engine starts itself (engine/tensor_parallel.py), which
    Ray does not count: a replica asks for `replica_cpus` per process, so
    Ray places no more replicas than the CPUs hold."""
    return (engine_options or {}).get("tensor_parallel_size", 1)


def start_ray(address: str | None = None, num_cpus: int | None = None, log_to_driver: bool = True) -> None:
    """Join the cluster at `address`, or start a local Ray. Workers import
    hybridkv as this process does (its PYTHONPATH goes with them). A
    SIGTERM handler the process has stays its own (_sigterm_after_init)."""
    if ray.is_initialized():
        return
    env = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
    runtime_env = {"env_vars": env} if env else None
    with _sigterm_after_init():
        if address:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=log_to_driver)
        else:
            ray.init(num_cpus=num_cpus, runtime_env=runtime_env, include_dashboard=False,
                     log_to_driver=log_to_driver)


@contextlib.contextmanager
def _sigterm_after_init():
    """A SIGTERM while ray.init runs is held until it returns, then goes
    to the process's own handler (serve_replicas': stop as Ctrl-C does,
    with every process of Ray). ray.init would put handlers of its own in
    place, through `ray._private.utils.set_sigterm_handler` (the driver's
    exits at once, code 15; a local head node's kills Ray's processes but
    not the agents below its raylet, then exits 1): those installs are
    skipped. And a ray.init cut short would leave processes behind that
    nothing knows of (Ray knows its node once ray.init returns). A process
    without a handler of its own keeps Ray's."""
    utils = ray._private.utils
    install, ours = getattr(utils, "set_sigterm_handler", None), signal.getsignal(signal.SIGTERM)
    if install is None or not callable(ours):
        yield
        return
    received = []
    utils.set_sigterm_handler = lambda handler: None
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        utils.set_sigterm_handler = install
        signal.signal(signal.SIGTERM, ours)
    if received:
        ours(signal.SIGTERM, None)


def serve_replicas(model_dir: str, *, model_name: str, num_replicas: int, address: str | None = None,
                   host: str = "127.0.0.1", port: int = 8000, **options) -> None:
    """What `hybridkv serve --replicas N` does: start (or join) Ray, run the
    application on Ray Serve's HTTP proxy at host:port, until interrupted
    (Ctrl-C or SIGTERM). Then the application is deleted, and a local Ray
    this call started is stopped with every process of it (stop_local_ray)."""
    # A SIGTERM stops here by the same path as Ctrl-C, from before Ray
    # starts (one during ray.init once it returns: start_ray), so that a
    # start cut short leaves no process behind either.
    signal.signal(signal.SIGTERM, _interrupt)
    serving = False
    try:
        cpus_per_replica = options.get("replica_cpus", 1.0) * _ranks(options.get("engine_options"))
        all_replicas = num_replicas + options.get("prefill_replicas", 0)
        start_ray(address, num_cpus=None if address else max(os.cpu_count() or 1,
                                                             int(all_replicas * cpus_per_replica) + 1))
        serve.start(http_options={"host": host, "port": port})
        serving = True
        serve.run(build_application(model_dir, model_name=model_name, num_replicas=num_replicas, **options),
                  name=APP_NAME, route_prefix="/")
        prefill = options.get("prefill_replicas", 0)
        roles = f" ({prefill} prefill, then decode)" if prefill else ""
        print(f"hybridkv: {num_replicas} engine replicas{roles} of {model_name} on Ray Serve at "
              f"http://{host}:{port}/v1", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, also while the replicas start
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if serving:  # (without Serve, serve.delete fails; without Ray, it would start one)
                serve.delete(APP_NAME)
        finally:
            if not address:
                stop_local_ray()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def stop_local_ray(grace_s: float = 2.0) -> None:
    """Stop Ray Serve and the local Ray this process started, with every
    process of it. `ray.shutdown()` stops the processes Ray started itself,
    but the agents its raylet started (DashboardAgent, RuntimeEnvAgent)
    ignore SIGTERM and, their parent gone, live on under PID 1: so Ray's
    processes and all below them are listed first, given `grace_s` seconds
    to exit after the shutdown, then killed."""
    processes = _local_ray_processes()
    try:
        if ray.is_initialized():  # (serve.shutdown would start a Ray to look for Serve in)
            serve.shutdown()
    finally:
        ray.shutdown()
        end_processes(processes, grace_s)


def _local_ray_processes() -> dict[int, str]:
    """The processes of the Ray node this process started (none if it only
    joined a cluster) and every process below them."""
    node = getattr(ray._private.worker, "_global_node", None)
    roots = [info.process.pid for infos in getattr(node, "all_processes", {}).values() for info in infos
             if getattr(info, "process", None) is not None]
    return processes_below(roots)
