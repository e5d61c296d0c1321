"""Under PROMETHEUS_MULTIPROC_DIR (llm-d's overlays set it) the server reads
only the metric files processes write; custom collectors are invisible there.
The tier gauges must still be exported and hold their value between scrapes."""

import os
import subprocess
import sys
import textwrap


def test_tier_gauges_exported_and_held_in_multiprocess_mode(tmp_path):
    engine = textwrap.dedent(
        """
        from prometheus_client import CollectorRegistry
        from tpu_offload.core import LRUChunkManager, make_chunk_key
        from tpu_offload.core.metrics import OffloadMetrics

        m = LRUChunkManager(10, 1024)
        metrics = OffloadMetrics(registry=CollectorRegistry())
        metrics.add_tier("cpu", m.stats)
        metrics.add_gauge("tpu_inference:prefix_cache_staging_buffer_free", "free", lambda: 7)
        keys = [make_chunk_key(bytes([i]) * 32) for i in range(3)]
        m.complete_store(m.prepare_store(keys).keys)
        metrics.refresh(force=True)
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", engine], env=env, check=True, timeout=120)

    server = textwrap.dedent(
        """
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        r = CollectorRegistry()
        MultiProcessCollector(r)
        print(generate_latest(r).decode())
        """
    )
    scrapes = [
        subprocess.run([sys.executable, "-c", server], env=env, check=True, timeout=120,
                       capture_output=True, text=True).stdout
        for _ in range(2)
    ]
    for text in scrapes:  # the engine process is gone: values must hold, not reset
        assert 'tpu_offload_tier_used_chunks{tier="cpu"} 3.0' in text, text
        assert 'tpu_offload_tier_capacity_bytes{tier="cpu"} 10240.0' in text, text
        assert "tpu_inference:prefix_cache_staging_buffer_free 7.0" in text, text


def test_a_change_inside_the_throttle_second_still_reaches_the_files(tmp_path):
    """The last stores of a burst complete in a step less than a second after the previous
    refresh, and an idle engine calls nothing after it: the files must still catch up."""
    engine = textwrap.dedent(
        """
        import time
        from prometheus_client import CollectorRegistry
        from tpu_offload.core import LRUChunkManager, make_chunk_key
        from tpu_offload.core.metrics import OffloadMetrics

        m = LRUChunkManager(10, 1024)
        metrics = OffloadMetrics(registry=CollectorRegistry())
        metrics.add_tier("cpu", m.stats)
        keys = [make_chunk_key(bytes([i]) * 32) for i in range(3)]
        alloc = m.prepare_store(keys)
        metrics.refresh(force=True)  # 3 pending
        m.complete_store(alloc.keys)
        metrics.refresh()  # inside the second: throttled
        time.sleep(1.5)  # idle: no further call
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", engine], env=env, check=True, timeout=120)
    server = ("from prometheus_client import CollectorRegistry, generate_latest\n"
              "from prometheus_client.multiprocess import MultiProcessCollector\n"
              "r = CollectorRegistry(); MultiProcessCollector(r); print(generate_latest(r).decode())\n")
    text = subprocess.run([sys.executable, "-c", server], env=env, check=True, timeout=120,
                          capture_output=True, text=True).stdout
    assert 'tpu_offload_tier_pending_chunks{tier="cpu"} 0.0' in text, text
    assert 'tpu_offload_tier_used_chunks{tier="cpu"} 3.0' in text, text
