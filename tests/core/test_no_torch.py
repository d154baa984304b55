"""kvpage.core is pure Python: every module in it (found by pkgutil, so new files are covered too)
imports, and the manager runs, with torch made unimportable. So do the torch-free modules named below,
with Ray unimportable too (the fleet's index, policies and metric families run without it)."""

import subprocess
import sys

BLOCK_TORCH = """
import importlib, pkgutil, sys, traceback
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "ray"):
            raise ImportError(f"{name} is not allowed here")
sys.meta_path.insert(0, _NoTorch())
import kvpage.core
names = sorted(m.name for m in pkgutil.walk_packages(kvpage.core.__path__, "kvpage.core."))
names += ["kvpage.core_demo", "kvpage.tools.scheduler_sim", "kvpage.fleet.index", "kvpage.fleet.routing",
          "kvpage.fleet.metric_families", "kvpage.fleet.fleet_feed", "kvpage.tools.fleet_sim", "kvpage.kvstore",
          "kvpage.kvstore.redis_store"]
for name in names:
    try:
        importlib.import_module(name)
    except Exception:
        print(f"FAILED {name}")
        traceback.print_exc(file=sys.stdout)
print("imported", " ".join(names))
from kvpage.core import KVCacheManager
m = KVCacheManager(4, 2, watermark=0.0)
tokens = [1, 2, 3]
adm = m.check_admission([tokens])
m.admit(["s"], [tokens], adm)
m.cache_blocks("s", tokens, 3)
m.commit()
m.check_invariants({"s": tokens})
m.free("s")
m.check_invariants()
print("torch loaded:", any(k == "torch" or k.startswith("torch.") for k in sys.modules))
"""


def test_core_imports_and_runs_without_torch():
    out = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILED" not in out.stdout, out.stdout
    lines = out.stdout.splitlines()
    imported = lines[-2].split()[1:]
    # pkgutil must have found the modules we know of, or the loop above proved nothing
    for name in ("kvpage.core.kv_cache_manager", "kvpage.core.block_pool", "kvpage.core.scheduler"):
        assert name in imported, imported
    assert lines[-1] == "torch loaded: False"
