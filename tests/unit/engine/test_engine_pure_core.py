"""The engine's core (block pool, KV cache manager, batch scheduler, requests, config) stays
torch-free, so it can be tested and reused without processes or tensors."""

import subprocess
import sys

PROBE = """
import sys
import engine.batch_scheduler, engine.block_pool, engine.kv_cache_manager, engine.request, engine.config
import engine.detokenizer
print("torch" in sys.modules)
"""


def test_core_imports_no_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
