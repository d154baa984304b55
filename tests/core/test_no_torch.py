import subprocess
import sys

BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not allowed in kvpage.core")
sys.meta_path.insert(0, _NoTorch())
import kvpage.core, kvpage.core_demo
from kvpage.core import KVCacheManager
m = KVCacheManager(4, 2)
p = m.find_cached_prefix([1, 2, 3])
assert m.allocate_slots("s", [1, 2, 3], p) is not None
m.free("s")
m.check_invariants()
assert not any(k == "torch" or k.startswith("torch.") for k in sys.modules)
print("ok")
"""


def test_core_imports_and_runs_without_torch():
    out = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
