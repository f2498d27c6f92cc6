"""Disaggregated prefill/decode in one front end: ``prefill_cores`` engine cores that only prefill
and ``decode_cores`` that decode, each in its own process (or a Ray actor, on any node), KV moved
through shared memory or pulled over TCP (``kv_transfer_transport``, kv_connector/pd/transport.py).

Each request goes first to a prefill core as a one-token request: the core computes the prompt and
hands its KV to the transport (a transfer file; tcp: its own server's memory) right after that
forward. Then the same request (same id, prompt and sampling parameters; tcp: and the prefill
core's address) goes to a decode core, which loads the transfer instead of computing the prompt, computes the last prompt token, samples the first token itself
and streams as any engine does: the prefill core's token is not used, so sampling, penalties and
seeds behave exactly as on one core. A prompt's prefill thus never shares a step with other
users' decodes. Each side picks its least loaded core (requests in flight from this front end).

Aborts: leaving the stream early (or ``abort``) aborts the request on whichever core has it,
which frees its blocks there, and deletes its transfer if it was written but not claimed (again a
little later, for a step already in flight when the abort landed; past ``kv_transfer_lease_s`` the
prefill cores' sweep deletes whatever is left). A core that dies fails its requests with
``EngineDeadError`` (the async engine's own death detection). Built from ``AsyncLLMEngine``s with
``engine_core_process=True``, so this module adds routing only.

``PDEngine`` implements the front ends' one interface (engine/protocol.py: ``EngineClient``, what
the OpenAI server and the adapters use: generate, abort, encode, the checks, stats, health, the
model's facts) and ``AsyncLLMEngine.from_config`` returns one for a config with prefill and decode
cores, so ``asyncengine serve --prefill-cores P --decode-cores D`` serves through it unchanged. The model's
facts come from a decode core (every core loads the same model); the engine counts as errored once
any core died (a request needs both sides); ``stats()`` sums the pools over the cores, as data
parallel does, with each core's own under ``cores`` (and ``prefill``/``decode``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncengine.config import EngineConfig
from asyncengine.engine import validation
from asyncengine.engine_core.core_stats import combine
from asyncengine.engine.lora_registry import NamedLoRAs
from asyncengine.engine.pd_stream import PDStream
from asyncengine.engine.protocol import EngineClient
from asyncengine.errors import ConfigError, EngineDeadError, InvalidRequestError
from asyncengine.kv_connector.pd import transfer_file as tf
from asyncengine.kv_connector.pd.transport import make_transport
from asyncengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncengine.engine.async_engine import AsyncLLMEngine

# when to look again for the transfer file of a request that left during its prefill
ORPHAN_RECHECK_S = (0.05, 0.5, 2.0, 10.0)
# per-core keys of an AsyncLLMEngine's stats that mean nothing summed over P/D cores
_FRONT_END_KEYS = ("cores", "data_parallel_size", "dp_prefix_affinity_routed", "cores_alive", "errored",
                   "num_streams", "uptime_s")


class PDEngine(NamedLoRAs, EngineClient):
    def __init__(self, config: EngineConfig, skip_hop_below: int | None = None, *,
                 core_engine: Callable[[EngineConfig], AsyncLLMEngine]) -> None:
        """Built by ``AsyncLLMEngine.from_config`` (the one factory), which hands itself over as
        ``core_engine``: the front end of each prefill and decode core (so this module, built of
        them, need not import the module that builds it). ``skip_hop_below`` (default
        ``config.pd_skip_hop_below``): prompts of fewer tokens (token ids or text; chat messages
        always take the hop) go straight to a decode core, which computes them itself: a short
        prompt's prefill stalls the decodes little, and the hop costs it a queue and a step."""
        if config.prefill_cores < 1 or config.decode_cores < 1:
            raise ValueError("PDEngine needs prefill_cores >= 1 and decode_cores >= 1")
        self.config = config
        self.skip_hop_below = config.pd_skip_hop_below if skip_hop_below is None else skip_hop_below
        self.num_skipped_hops = 0
        base = config.kv_transfer_dir or tf.default_dir()
        os.makedirs(base, exist_ok=True)
        _remove_dead_folders(base)
        # a folder per front end (named by its pid): its cores' files, removed with it
        self.transfer_dir = tempfile.mkdtemp(prefix=f"pd-{os.getpid()}-", dir=base)
        # each core its share of the CPUs unless told otherwise (they all step at once)
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // (config.prefill_cores + config.decode_cores))

        self.transport = make_transport(config.kv_transfer_transport, self.transfer_dir)
        self.sources: dict[int, str | None] = {}  # prefill core (by id) -> its transfer address (tcp)

        ray = config.distributed_executor_backend == "ray"

        def core(role: str) -> AsyncLLMEngine:
            # a prefill core samples one token: speculation (a draft model's forwards) only on decode cores
            # tcp: a prefill core serves its transfers on a port its own node's OS picks (a Ray actor
            # on every address of its node), reported when it is ready; decode cores are told where
            serve = role == "prefill" and self.tcp
            bind = ("0.0.0.0:0" if ray else "127.0.0.1:0") if serve else None
            e = core_engine(dataclasses.replace(
                config, prefill_cores=0, decode_cores=0, kv_role=role, kv_transfer_dir=self.transfer_dir,
                kv_transfer_address=bind, engine_core_process=True, data_parallel_size=1, num_threads=threads,
                speculative_config=config.speculative_config if role == "decode" else None))
            self.sources[id(e)] = e.kv_transfer_address
            return e

        self.tcp = config.kv_transfer_transport == "tcp"
        self.prefill: list[AsyncLLMEngine] = []
        self.decode: list[AsyncLLMEngine] = []
        try:
            self.prefill += [core("prefill") for _ in range(config.prefill_cores)]
            self.decode += [core("decode") for _ in range(config.decode_cores)]
        except BaseException:
            self._stop_cores()
            raise
        self.load = {id(e): 0 for e in self.engines}  # requests in flight from this front end, per core
        self._streams: dict[str, PDStream] = {}
        self._closing = False
        self._closed = False
        self._started_at = time.monotonic()

    def _stop_cores(self) -> None:
        for e in self.engines:
            try:
                e.client.shutdown()
            except Exception:
                pass
        self._remove_transfer_dir()

    # ------------------------------------------------------------------ what front ends read

    @property
    def engines(self) -> list[AsyncLLMEngine]:
        return self.prefill + self.decode

    @property
    def tokenizer(self):
        return self.decode[0].tokenizer

    @property
    def limits(self) -> validation.RequestLimits:
        return self.decode[0].limits

    @property
    def default_sampling_params(self) -> SamplingParams:
        return self.decode[0].default_sampling_params

    @property
    def max_model_len(self) -> int:
        return min(e.max_model_len for e in self.engines)

    @property
    def vocab_size(self) -> int:
        return self.decode[0].vocab_size

    @property
    def dtype(self) -> str:
        return self.decode[0].dtype

    @property
    def kernels(self) -> str:
        return f"{self.decode[0].kernels}; P/D {len(self.prefill)} prefill + {len(self.decode)} decode cores"

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.decode[0].supported_tasks

    @property
    def default_pooling(self) -> str:
        return self.decode[0].default_pooling

    @property
    def errored(self) -> bool:
        """Once any core died: a request needs a core of each side (the server then stops)."""
        return any(e.errored for e in self.engines)

    @property
    def is_closing(self) -> bool:
        return self._closing or any(e.is_closing for e in self.engines)

    @property
    def is_running(self) -> bool:
        return all(e.is_running for e in self.engines)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self.decode[0].loop

    def cores_alive(self) -> tuple[int, int]:
        return sum(not e.errored for e in self.engines), len(self.engines)

    def check_sampling_params(self, params: SamplingParams) -> SamplingParams:
        return self.decode[0].check_sampling_params(params)

    async def check_structured_outputs(self, params: SamplingParams) -> SamplingParams:
        return await self.decode[0].check_structured_outputs(params)

    async def encode(self, prompt) -> tuple[str | None, list[int]]:
        return await self.decode[0].encode(prompt)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        for e in self.engines:
            await e.start()

    async def shutdown(self, drain: bool = True) -> None:
        """As ``AsyncLLMEngine.shutdown``. drain=True: the prefill cores finish their requests first,
        then the decode cores theirs (a request not yet handed to a decode core by then, because
        nobody read its stream, fails with EngineDeadError)."""
        if self._closed:
            return
        self._closing = True
        if drain:
            await asyncio.gather(*(e.shutdown(drain=True) for e in self.prefill), return_exceptions=True)
        await asyncio.gather(*(e.shutdown(drain=drain) for e in self.engines), return_exceptions=True)
        self._closed = True
        self._remove_transfer_dir()

    def _num_transfers(self) -> int:
        """Transfers not loaded yet: files here (shm; tcp: pulled, not loaded), and held by the
        prefill cores' servers (tcp)."""
        held = self.transport.num_held([a for a in self.sources.values() if a]) if self.tcp else 0
        try:
            return held + len(os.listdir(self.transfer_dir))
        except OSError:
            return held

    def _remove_transfer_dir(self) -> None:
        for name in os.listdir(self.transfer_dir):
            try:
                os.unlink(os.path.join(self.transfer_dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self.transfer_dir)
        except OSError:
            pass

    # ------------------------------------------------------------------ requests

    def _pick(self, engines: list[AsyncLLMEngine]) -> AsyncLLMEngine:
        return min(engines, key=lambda e: (e.errored, self.load[id(e)]))

    def _num_prompt_tokens(self, prompt) -> int | None:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return len(prompt["prompt_token_ids"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if isinstance(prompt, str) and self.tokenizer is not None:
            return len(self.tokenizer.encode(prompt))
        return None  # chat messages: the template is the engine's to apply

    def _takes_hop(self, prompt, params: SamplingParams) -> bool:
        if params.prompt_logprobs is not None or params.pooling is not None:
            return False  # the decode core computes such a prompt anyway (its logits, or its embedding)
        if not self.skip_hop_below:
            return True
        n = self._num_prompt_tokens(prompt)
        return n is None or n >= self.skip_hop_below

    def generate(self, prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, priority: int = 0, cache_salt: str | None = None,
                 lora_request=None) -> PDStream:
        """As ``AsyncLLMEngine.generate``: submits now (a bad request raises here) and returns the
        request's async iterator of RequestOutputs, streamed by the decode core."""
        if self._closing or self._closed:
            raise EngineDeadError("the engine is shutting down")
        params = self.decode[0].processor.resolve(sampling_params)  # unset fields: the model's defaults
        self.check_sampling_params(params)
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex[:16]}"
        validation.check_request_id(rid, self.limits)
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is already in use by a live request")
        if lora_request is not None:
            self._check_lora(lora_request)  # here, not at the prefill core: a bad adapter raises now
        hop = self._takes_hop(prompt, params)
        self.num_skipped_hops += not hop
        p = self._pick(self.prefill) if hop else None
        stream = PDStream(rid, prompt, params, {"priority": priority, "cache_salt": cache_salt, "lora_request": lora_request},
                          p, self._pick(self.decode), self.load, self.stream_closed,
                          source=self.sources.get(id(p)))
        self._streams[rid] = stream
        return stream

    def _check_lora(self, lora_request) -> None:
        self.decode[0]._check_lora(lora_request)  # every core serves the same model and limits

    def stream_closed(self, stream: PDStream, finished: bool) -> None:
        """The stream ended; ``finished`` False: before a decode core claimed its transfer, which
        is deleted now, and, if it left during its prefill, again a little later: a step already
        in flight when the abort reached the prefill core writes the file after it (the prefill
        cores' sweep would only see it at their next step after the lease)."""
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
        if finished:
            return
        self._discard(stream.request_id, stream.source)
        if stream.closed_in_prefill:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # dropped outside the loop (garbage collection): the sweep's then
                return
            for delay in ORPHAN_RECHECK_S + (self.config.kv_transfer_lease_s,):
                loop.call_later(delay, self._discard, stream.request_id, stream.source)

    def _discard(self, request_id: str, source: str | None) -> None:
        """Delete a request's transfer wherever it waits (tcp: on a thread, never on the loop)."""
        if self.tcp:
            threading.Thread(target=self.transport.delete, args=(request_id, source), daemon=True,
                             name="asyncengine-pd-discard").start()
        else:
            self.transport.delete(request_id, source)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            await stream.abort()

    # ------------------------------------------------------------------ a trainer's controls
    # (AsyncLLMEngine's, engine/trainer_api.py, over every prefill and decode core at once)

    @property
    def weights_version(self) -> int:
        return self.decode[0].weights_version

    @property
    def is_paused(self) -> bool:
        return self.decode[0].is_paused

    async def update_weights(self, weights, *, partial: bool = False) -> int:
        """Staged on every core of both sides before any commits (engine_core/core_control.py)."""
        from asyncengine.engine_core.core_control import update_all  # lazy: the front end imports no torch: core code loads only where it runs here
        from asyncengine.engine_core.weight_sync import normalize  # lazy: the front end imports no torch: core code loads only where it runs here

        update = normalize(weights, partial)
        version = await update_all([c for e in self.engines for c in e.client.live_cores()], update)
        for e in self.engines:
            e.client.weights_version = version
        return version

    async def reset_prefix_cache(self) -> None:
        await asyncio.gather(*(e.reset_prefix_cache() for e in self.engines))

    async def pause_generation(self, mode: str = "abort") -> None:
        await asyncio.gather(*(e.pause_generation(mode) for e in self.engines))

    async def resume_generation(self) -> None:
        await asyncio.gather(*(e.resume_generation() for e in self.engines))

    @property
    def is_sleeping(self) -> bool:
        return False

    async def sleep(self, level: int = 1) -> None:
        """Refused: a P/D core's KV connector holds its cache (worker/sleep_mode.py refuses it too)."""
        raise ConfigError("sleep is not supported with prefill/decode cores: their KV connectors hold the cache")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        raise ConfigError("sleep is not supported with prefill/decode cores: their KV connectors hold the cache")

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        """The pools and counters summed over every core (as data parallel: what /metrics reads),
        each core's own under ``cores`` (with its ``role``) and under ``prefill``/``decode``."""
        def core(e: AsyncLLMEngine, role: str) -> dict:
            s = {k: v for k, v in e.stats().items() if k not in _FRONT_END_KEYS}
            return {**s, "role": role, "errored": e.errored}

        prefill = [core(e, "prefill") for e in self.prefill]
        decode = [core(e, "decode") for e in self.decode]
        out = combine(prefill + decode)
        out.update(
            tokens_per_s=sum(s.get("tokens_per_s", 0) for s in decode),
            total_output_tokens=sum(s.get("total_output_tokens", 0) for s in decode),
            num_streams=len(self._streams), uptime_s=time.monotonic() - self._started_at, errored=self.errored,
            cores_alive=self.cores_alive()[0], cores=prefill + decode, prefill=prefill, decode=decode,
            prefill_cores=len(prefill), decode_cores=len(decode), num_skipped_hops=self.num_skipped_hops,
            transfer_files=self._num_transfers() if not self._closed else 0)
        return out


def _remove_dead_folders(base: str) -> None:
    """Transfer folders of front ends that died without shutting down (their cores died with them)."""
    import shutil

    for name in os.listdir(base):
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "pd" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        except PermissionError:
            pass
