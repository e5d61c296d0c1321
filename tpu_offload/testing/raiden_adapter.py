"""tpu-inference's RaidenOffloadConnector, made to start with the published tpu-sync wheel.

tpu-inference 0.32 ships ``tpu_inference.offload.raiden_offload_connector``:
no staging buffer, every block copied straight between the paged KV cache and
host memory by Google's tpu-sync engine (PyPI ``tpu-sync-jax``, the package
``tpu_sync``). As shipped it cannot start with the one published wheel
(0.0.1rc20261023185136), so comparing it needs this adapter. What it adapts,
and nothing else (every byte still moves through the wheel's C++
``KVCacheManager``: ``d2h_auto_allocate``, ``h2d``, ``unlock_blocks``):

* **Import name.** The connector imports ``tpu_raiden``, the package's old
  name; the wheel installs ``tpu_sync``. ``install_import_name()`` registers a
  ``tpu_raiden`` module holding the wheel's ``KVCacheManager`` and ``RaidenId``
  and ``StoreAdapter`` (below) as ``KVCacheStore``, before the connector's
  module is imported.
* **Store API.** The connector was written against an older ``KVCacheStore``:
  ``KVCacheStore(capacity=N)`` (the wheel also requires ``num_shards`` and
  ``store_server_ip``: a TypeError at engine start), ``lookup`` that does not
  pin plus a separate ``pin`` (the wheel has no ``pin``; its ``lookup`` pins
  what it finds unless told not to), ``insert(hashes, RaidenId list,
  on_host)`` returning ``(all_inserted, evicted)`` (the wheel takes
  ``RaidenBlockId``s and returns one bool). ``StoreAdapter`` maps each old
  call onto the wheel's. The wheel evicts silently (its eviction callback did
  not fire for LRU evictions on insert here), so evictions are found by probing
  the entries this adapter inserted, only once more were inserted than the
  store holds; the connector then unlocks their host blocks as it intends.
* **Ordering (opt-in).** As shipped, the connector's ``wait_for_save`` issues
  the device-to-host copies right after the step's forward is dispatched, not
  after it ran: with JAX's asynchronous dispatch the copies can read blocks
  the forward has not written yet, and a later restore serves that stale KV.
  With ``wait_for_forward`` in ``kv_connector_extra_config``
  (``kv_transfer_config(ordered=True)``) a step's saves first wait for the
  step's KV cache (``jax.block_until_ready`` on the runner's caches), only in
  steps that save; without it the connector runs as shipped.

Nothing here changes what the connector decides (what to save, load, evict)
or how its failures surface: those are part of what is compared. This module
imports only the standard library until the engine asks for the connector
class, and depends on nothing else here, so it can move with one ``git mv``.
"""

from __future__ import annotations

import sys
import types

# The wheel this adapter was written against (and the lock pins).
WHEEL = "tpu-sync-jax==0.0.1rc20261023185136"
STORE_SERVER_IP = "127.0.0.1"  # the wheel's store serves its directory here; one host, one shard


def install_import_name() -> None:
    """Register ``tpu_raiden`` (the connector's import name) backed by the wheel's ``tpu_sync``."""
    if "tpu_raiden" in sys.modules:
        return
    try:
        from tpu_sync.api.jax.kv_cache_manager import KVCacheManager
        from tpu_sync.frameworks.jax import _tpu_raiden_jax as native
    except ImportError as err:
        raise ImportError(f"RaidenOffloadConnector needs the tpu-sync wheel ({WHEEL}); "
                          f"install it into the tpu-inference environment: {err}") from err
    if "tpu_inference.offload.raiden_offload_connector" in sys.modules:
        raise RuntimeError("tpu_inference.offload.raiden_offload_connector was imported before "
                           "raiden_adapter.install_import_name(): it has bound tpu_raiden to None")
    mod = types.ModuleType("tpu_raiden")
    mod.KVCacheManager = KVCacheManager
    mod.RaidenId = native.RaidenId
    mod.KVCacheStore = StoreAdapter
    sys.modules["tpu_raiden"] = mod


class StoreAdapter:
    """The older ``KVCacheStore`` calls the connector makes, on the wheel's store."""

    def __init__(self, capacity: int):
        from tpu_sync.frameworks.jax import _tpu_raiden_jax as native

        self._native = native
        self._store = native.KVCacheStore(capacity=capacity, num_shards=1, store_server_ip=STORE_SERVER_IP)
        self._capacity = capacity
        self._inserted: dict[bytes, object] = {}  # hash -> RaidenBlockId, to find silent evictions

    def lookup(self, block_hashes):
        """Hits before the first miss, as ``(hash, id)``; pins nothing (``pin`` does)."""
        return [(h, BlockView(b)) for h, b in self._store.lookup(list(block_hashes), pin_found=False)]

    def pin(self, block_hashes) -> None:
        self._store.lookup(list(block_hashes), pin_found=True)

    def release(self, block_hashes) -> None:
        self._store.release(list(block_hashes))

    def insert(self, block_hashes, raiden_ids, on_host: bool = True):
        """``(all_inserted, evicted)``, ``evicted`` as ``(hash, id)`` pairs."""
        hashes = list(block_hashes)
        blocks = [self._native.RaidenBlockId(r, host_block_id=r.data_replica_idx,
                                             status=self._native.BlockStatus.HOST) for r in raiden_ids]
        ok = bool(self._store.insert(hashes, blocks, on_host))
        if ok:
            self._inserted.update(zip(hashes, blocks))
        return ok, self._evicted() if len(self._inserted) > self._capacity else []

    def _evicted(self) -> list:
        gone = [h for h in self._inserted if not self._store.lookup([h], pin_found=False)]
        return [(h, BlockView(self._inserted.pop(h))) for h in gone]


class BlockView:
    """The older lookup result: a block id with its ``RaidenId``'s fields as properties."""

    __slots__ = ("block",)

    def __init__(self, block):
        self.block = block

    def __getattr__(self, name):
        return getattr(self.block.raiden_id, name)


def _build_connector_class():
    install_import_name()
    from tpu_inference.offload.raiden_offload_connector import RaidenOffloadConnector as Shipped

    class RaidenOffloadConnector(Shipped):
        """tpu-inference's connector (import name and store calls adapted); with ``wait_for_forward``
        in ``kv_connector_extra_config``, a step's saves wait until its forward has written the KV
        cache. It keeps the shipped name: tpu-inference's platform accepts only its own connector
        names (``kv_connector_module_path`` picks this module)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
            self.wait_for_forward = bool(extra.get("wait_for_forward", False))
            self.forward_wait_s = 0.0  # of wait_for_save's time, spent waiting for the forward
            self._runner = None

        def register_runner(self, runner) -> None:
            self._runner = runner
            super().register_runner(runner)

        def wait_for_save(self) -> None:
            if self.wait_for_forward and self._saves_this_step():
                import time

                import jax

                t0 = time.perf_counter()
                jax.block_until_ready(self._runner.kv_caches)
                self.forward_wait_s += time.perf_counter() - t0
            super().wait_for_save()

        def _saves_this_step(self) -> bool:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            return meta is not None and any(r.save_spec and not r.save_spec.skip_save and r.save_spec.src_blocks
                                            for r in meta.requests_meta)

    RaidenOffloadConnector.__module__ = __name__
    return RaidenOffloadConnector


def __getattr__(name: str):
    """``RaidenOffloadConnector`` is built on first use (vLLM's ``getattr`` on this module), so
    importing this module for ``kv_transfer_config`` loads neither tpu-inference nor the wheel."""
    if name == "RaidenOffloadConnector":
        cls = globals()[name] = _build_connector_class()
        return cls
    raise AttributeError(name)


def kv_transfer_config(ordered: bool) -> dict:
    """The engine's ``kv_transfer_config``: as shipped, or (``ordered``) with the ordering fix. Sizes
    come from ``TPU_OFFLOAD_*`` env, as for tpu-inference's other connector
    (``TPU_OFFLOAD_NUM_CPU_CHUNKS``: the host tier's blocks)."""
    return {"kv_connector": "RaidenOffloadConnector", "kv_connector_module_path": __name__, "kv_role": "kv_both",
            "kv_connector_extra_config": {"wait_for_forward": ordered}}
