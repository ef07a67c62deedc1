"""bm25s imports JAX when installed and runs a top-k at import, which starts JAX's default backend: on a GPU node
with a CUDA jaxlib that preallocates 75% of the card (seen on an H100, issue 31). Our BM25 retriever imports
bm25s with JAX hidden. A fake ``jax`` package on the path records whether it was imported; each case runs in a
fresh interpreter, since bm25s is imported once per process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BUILD_AND_SEARCH = """
import sys
from searchrl.core.records import Doc
from searchrl.envs.retrievers.bm25 import BM25Retriever
docs = [Doc("a", "Paris", "Paris is the capital of France."), Doc("b", "Berlin", "Berlin is in Germany.")]
hits = BM25Retriever(docs).search(["capital of France"], 1)
print(hits[0][0].id, "jax" in sys.modules)
"""


@pytest.fixture
def fake_jax(tmp_path: Path) -> tuple[dict[str, str], Path]:
    pkg = tmp_path / "site" / "jax"
    pkg.mkdir(parents=True)
    marker = tmp_path / "jax-imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    (pkg / "lax.py").write_text("def top_k(x, k):\n    return x[:k], list(range(k))\n")
    src = Path(__file__).resolve().parents[3] / "src"
    path = os.pathsep.join([str(tmp_path / "site"), str(src), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}, marker


def run(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_fake_jax_is_what_bm25s_imports(fake_jax):
    env, marker = fake_jax
    assert run("import bm25s, sys; print('jax' in sys.modules)", env) == "True"
    assert marker.exists()


def test_bm25_retriever_imports_bm25s_without_jax(fake_jax):
    env, marker = fake_jax
    assert run(BUILD_AND_SEARCH, env) == "a False"
    assert not marker.exists()


def test_jax_loaded_by_the_user_is_left_alone(fake_jax):
    env, marker = fake_jax
    assert run("import jax\n" + BUILD_AND_SEARCH, env) == "a True"
    assert marker.exists()
