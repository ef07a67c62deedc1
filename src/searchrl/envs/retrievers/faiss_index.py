"""faiss indexes for every memory budget, named by index-factory specs (inner product on normalised vectors):

- ``Flat``: exact; 4·d bytes per vector (21M × 768: 64 GB);
- ``HNSW32``: graph search, about as large as Flat plus the graph, fast and accurate;
- ``IVF{n},SQ8``: inverted lists, 8-bit scalar codes (d bytes per vector, a quarter of Flat);
- ``IVF{n},PQ{m}`` / ``OPQ{m},IVF{n},PQ{m}``: product codes of m bytes per vector (21M × PQ64: 1.3 GB).

Quantised and IVF indexes are trained on a random sample of the vectors (``train_size``); ``nprobe`` (IVF)
and ``efSearch`` (HNSW) trade speed for recall at query time. Saved indexes load memory-mapped where faiss
supports it (IVF lists), so start-up does not read the whole file. With faiss-gpu and a CUDA device the
index is copied to the GPUs (``shard``: split over them instead of replicated) — written for GPU users,
not run on this CPU-only machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from searchrl.core.errors import DataError

SPEC_EXAMPLES = ("Flat", "HNSW32", "IVF1024,SQ8", "IVF1024,PQ64", "OPQ64,IVF1024,PQ64")


def faiss_module() -> Any:
    try:
        import faiss
    except ImportError as exc:
        raise ImportError(
            "dense retrieval needs faiss: `pip install 'searchrl[dense]'` (or faiss-gpu)"
        ) from exc
    return faiss


def build_index(
    vectors: np.ndarray, spec: str = "Flat", train_size: int = 100_000, seed: int = 0, batch: int = 65_536
) -> Any:
    """An index of ``vectors`` (n × d float32, L2-normalised) built from the factory ``spec``."""
    faiss = faiss_module()
    n, d = vectors.shape
    try:
        index = faiss.index_factory(d, spec, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise DataError(
            f"faiss cannot build index type {spec!r} for {d}-dimensional vectors "
            f"({str(exc).strip().splitlines()[-1]}); e.g. {', '.join(SPEC_EXAMPLES)} "
            "(PQ m must divide the dimension; IVF n wants at least 39·n training vectors)"
        ) from None
    if not index.is_trained:
        rng = np.random.default_rng(seed)
        sample = vectors if n <= train_size else vectors[np.sort(rng.choice(n, train_size, replace=False))]
        index.train(np.ascontiguousarray(sample, dtype=np.float32))
    for start in range(0, n, batch):  # in slices: memory-mapped vectors are read piece by piece
        index.add(np.ascontiguousarray(vectors[start : start + batch], dtype=np.float32))
    return index


def set_search_params(index: Any, nprobe: int | None = None, ef_search: int | None = None) -> None:
    """Query-time knobs: IVF lists probed, HNSW candidate-list size. Ignored where the index has none."""
    faiss = faiss_module()
    params = faiss.ParameterSpace()
    for name, value in (("nprobe", nprobe), ("efSearch", ef_search)):
        if value is None:
            continue
        try:
            params.set_index_parameter(index, name, int(value))
        except RuntimeError:
            continue  # e.g. nprobe on an HNSW index: not a parameter of this index type


def rerank(
    vectors: np.ndarray, queries: np.ndarray, ids: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner products of each query with its candidates' stored vectors, best ``k`` first.

    ``vectors`` may be memory-mapped (the saved embeddings): only the candidates' rows are read, so a
    compressed index (PQ codes in memory) regains exact ordering among its candidates without holding the
    vectors in memory. ``ids``: (n_queries, candidates), -1 for none. Returns (scores, ids), (n_queries, k),
    padded with -inf / -1."""
    n = len(queries)
    scores, out = np.full((n, k), -np.inf, dtype=np.float32), np.full((n, k), -1, dtype=np.int64)
    for i in range(n):
        cand = np.unique(ids[i][ids[i] >= 0])  # sorted: memory-mapped rows are read in file order
        if len(cand) == 0:
            continue
        s = np.asarray(vectors[cand], dtype=np.float32) @ queries[i]
        top = np.argsort(-s, kind="stable")[:k]
        scores[i, : len(top)], out[i, : len(top)] = s[top], cand[top]
    return scores, out


def save_index(index: Any, path: Path) -> None:
    faiss = faiss_module()
    if hasattr(faiss, "index_gpu_to_cpu") and type(index).__name__.startswith("Gpu"):
        index = faiss.index_gpu_to_cpu(index)
    faiss.write_index(index, str(path))


def load_index(path: Path) -> Any:
    """Read a saved index, memory-mapped when its type allows it (IVF inverted lists), else into memory."""
    faiss = faiss_module()
    try:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError:
        return faiss.read_index(str(path))


def to_gpus(index: Any, shard: bool = False) -> Any:
    """The index on every visible GPU (replicated, or ``shard``-ed over them); unchanged without faiss-gpu.
    Not run here: this machine has no GPU."""
    faiss = faiss_module()
    if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        return index
    options = faiss.GpuMultipleClonerOptions()
    options.shard = shard
    return faiss.index_cpu_to_all_gpus(index, co=options)
