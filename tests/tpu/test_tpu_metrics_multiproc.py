"""The TPU scheduler half starts under PROMETHEUS_MULTIPROC_DIR (llm-d's overlays set it).

In multiprocess mode a gauge is read as soon as it is registered, so every
value a gauge reads must exist before registration; the serving benchmark
found the scheduler reading its staging gauge before setting it.
"""

import os
import subprocess
import sys
import textwrap


def test_scheduler_starts_and_exports_gauges_in_multiprocess_mode(tmp_path):
    engine = textwrap.dedent(
        """
        from prometheus_client import CollectorRegistry
        from tpu_offload.connector.metrics import ConnectorMetrics
        from tpu_offload.connector.scheduler import OffloadScheduler
        from tpu_offload.connector.settings import Settings
        from tpu_offload.core.config import OffloadConfig

        cfg = OffloadConfig(num_cpu_chunks=8, staging_blocks=4, blocks_per_chunk=1)
        OffloadScheduler(Settings(config=cfg, block_size=16, blocks_per_chunk=1, num_slots=8, chunk_bytes=1024,
                                  staging_blocks=4), ConnectorMetrics(CollectorRegistry()))
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", engine], env=env, check=True, timeout=300)
    assert any(name.startswith("gauge") for name in os.listdir(tmp_path)), os.listdir(tmp_path)
