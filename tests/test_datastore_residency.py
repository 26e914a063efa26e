"""Keeping a datastore's pages in memory: lazy, warm and lock (sssd.datastore.RESIDENCY)."""

import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import sssd
from sssd.serving.engine import EngineConfig


@pytest.fixture
def ds(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5000, size=400_000, dtype=np.uint32)  # 1.6 MB per file: a few hundred pages
    built = sssd.Datastore.build(tokens, tmp_path / "ds")
    import os

    os.sync()  # clean pages: the kernel may reclaim them (dirty ones are written back first)
    return built


def test_modes_bring_pages_in_and_lock_keeps_them(ds):
    total = sum(f.stat().st_size for f in ds.path.iterdir() if f.suffix == ".bin")
    assert ds.make_resident("lazy") == 0
    if not ds.page_out():
        pytest.skip("this kernel has no MADV_PAGEOUT")
    assert ds.resident_bytes() < total // 2  # reclaimed
    assert ds.make_resident("warm") == total
    assert ds.resident_bytes() >= total - 3 * 4096  # every page in (the last of each file may be partial)
    ds.page_out()
    assert ds.resident_bytes() < total // 2  # warm pages can be reclaimed
    assert ds.make_resident("lock") == total
    ds.page_out()
    assert ds.resident_bytes() >= total - 3 * 4096  # locked pages cannot
    # queries are unchanged whatever the residency
    lo, hi = ds.native.find(np.asarray(ds.native.tokens()[100:103]))
    assert hi - lo >= 1


def test_unknown_residency_is_refused(ds):
    with pytest.raises(ValueError, match="lazy, warm, lock"):
        ds.make_resident("pinned")
    with pytest.raises(ValueError, match="datastore_residency"):
        EngineConfig(datastore_residency="pinned")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop CAP_IPC_LOCK")
def test_lock_beyond_the_memlock_limit_says_how_to_raise_it(ds):
    # A child without CAP_IPC_LOCK and a 64 KiB lockable-memory limit: locking 1.6 MB must fail
    # with one clear error, and the datastore stays usable.
    code = textwrap.dedent(f"""
        import resource
        import sssd
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
        ds = sssd.Datastore.open({str(ds.path)!r})
        try:
            ds.make_resident("lock")
        except sssd.SSSDError as e:
            print("ERROR", e)
        else:
            print("LOCKED")
        lo, hi = ds.native.find(ds.native.tokens()[:2].copy())
        print("FOUND", hi - lo)
    """)
    proc = subprocess.run(
        ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0 and "setpriv" in proc.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    if "LOCKED" in out:
        pytest.skip("the child could still lock (capabilities not dropped)")
    assert "cannot lock" in out and "tokens.bin" in out and "ulimit -l" in out and "65536" in out
    assert "FOUND" in out and "FOUND 0" not in out
