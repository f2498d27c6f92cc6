"""A trainer's controls on the async engine (mixed into AsyncLLMEngine; docs/training.md): weight
updates in place with a version on every output, prefix-cache resets, pausing generation around
them. The work happens in engine_core/weight_sync.py, engine/pause.py and the core clients
(engine/client_controls.py); this is the public surface."""
from __future__ import annotations


class TrainerControls:
    """Needs the engine's ``client``, ``_busy_loop``, ``_bind_loop`` and ``_control_lock``."""

    @property
    def weights_version(self) -> int:
        """0 as loaded, +1 per update_weights (every RequestOutput carries its tokens' versions)."""
        return self.client.weights_version

    async def update_weights(self, weights, *, partial: bool = False) -> int:
        """Replace the weights in place on every rank and core (docs/training.md): a state_dict,
        (name, tensor) pairs in the checkpoint's naming, or a safetensors path. All checked before
        anything changes (else WeightUpdateError, old weights serving); ``partial``: only the given
        tensors change. Resets the prefix cache; returns the new weights_version."""
        from asyncengine.engine_core import weight_sync  # lazy: the front end imports no torch: core code loads only where it runs here

        self._bind_loop()
        update = weight_sync.normalize(weights, partial)
        async with self._control_lock:  # one update at a time
            return await self.client.update_weights(update)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (new requests recompute theirs)."""
        self._bind_loop()
        await self.client.reset_prefix_cache()

    @property
    def is_paused(self) -> bool:
        return self._busy_loop.paused

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating (engine/pause.py); new requests wait, within the admission limits, for
        :meth:`resume_generation`. Running ones: ``"abort"`` ends them (finish_reason "abort"),
        ``"wait"`` returns once they finished, ``"keep"`` parks them with their KV until resumed."""
        from asyncengine.engine.pause import pause  # lazy: loaded on first use of this rarely used call

        self._bind_loop()
        await pause(self, mode)

    async def resume_generation(self) -> None:
        """Undo :meth:`pause_generation`: parked requests go on, waiting ones are handed over."""
        from asyncengine.engine.pause import resume  # lazy: loaded on first use of this rarely used call

        self._bind_loop()
        await resume(self)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.client.asleep)

    async def sleep(self, level: int = 1) -> None:
        """Give memory back to the OS while a trainer needs it (engine_core/sleep.py): level 1 frees the
        KV cache and packed weight copies, level 2 the weights too. Generation pauses (running
        requests are aborted, new ones wait) until :meth:`wake_up` has woken everything."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        self._bind_loop()
        async with self._control_lock:
            from asyncengine.engine.pause import pause  # lazy: loaded on first use of this rarely used call

            await pause(self, "abort")
            await self.client.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back ``tags`` (default both): "weights" (level 2: read from the checkpoint again, a
        new weights_version; or fill them with a full update_weights instead) and "kv_cache".
        Generation resumes once nothing sleeps."""
        self._bind_loop()
        async with self._control_lock:
            await self.client.wake_up(tags)
            if not self.client.asleep:
                from asyncengine.engine.pause import resume  # lazy: loaded on first use of this rarely used call

                await resume(self)
