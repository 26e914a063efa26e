"""Every Python example in the README runs, as written, against the real default model and datastore.

The examples run in order in one fresh interpreter (like a notebook), with the server
example pointed at a `sssd serve` started here on a free port. A README that drifts
from the code fails this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    blocks = python_blocks()
    assert len(blocks) >= 5
    assert any("OpenAI(" in b for b in blocks) and any("sssd.Drafter(" in b for b in blocks)


def test_every_readme_example_runs(tmp_path):
    blocks = python_blocks()
    port = free_port()
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "sssd.cli", "serve", "--port", str(port), "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    try:
        deadline = time.monotonic() + 900  # first use builds the datastore and pulls the model
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"sssd serve exited: {(tmp_path / 'serve.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("sssd serve did not come up")
        code = "\n".join(b.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for b in blocks)
        code += "\nprint('README-EXAMPLES-DONE')\n"
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-4000:]
        assert r.stdout.rstrip().endswith("README-EXAMPLES-DONE")
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
