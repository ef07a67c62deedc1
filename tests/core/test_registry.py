import pytest

from searchrl.core.errors import RegistryError
from searchrl.core.registry import Registry, import_path


def test_register_and_get_by_name_and_dotted_path():
    reg: Registry = Registry("thing")

    @reg.register("double")
    def double(x):
        return 2 * x

    assert reg.get("double")(3) == 6
    assert reg.get("searchrl.core.answers:normalize_answer")("The Cat!") == "cat"
    assert "double" in reg and "searchrl.core.answers:f1_score" in reg and "nope" not in reg
    assert reg.names() == ["double"]


def test_duplicate_name_is_an_error():
    reg: Registry = Registry("thing")
    reg.add("a", 1)
    with pytest.raises(RegistryError, match="thing 'a' is already registered"):
        reg.add("a", 2)
    with pytest.raises(RegistryError, match="already registered"):
        reg.add_lazy("a", "searchrl.core.answers:f1_score")


def test_lazy_entries_import_on_first_use():
    reg: Registry = Registry("thing")
    reg.add_lazy("f1", "searchrl.core.answers:f1_score")
    assert reg.names() == ["f1"]
    assert reg.get("f1")("a b", "a b") == 1.0


def test_unknown_name_suggests_close_match():
    reg: Registry = Registry("retriever")
    reg.add("bm25", object())
    with pytest.raises(RegistryError, match=r"unknown retriever 'bm52'; valid: bm25; did you mean 'bm25'\?"):
        reg.get("bm52")


def test_bad_dotted_paths():
    with pytest.raises(
        RegistryError, match="cannot import module 'no_such_pkg.mod' for 'no_such_pkg.mod:fn'"
    ):
        import_path("no_such_pkg.mod:fn")
    with pytest.raises(RegistryError, match="has no attribute 'nothing'"):
        import_path("searchrl.core.answers:nothing")
    with pytest.raises(RegistryError, match="not a dotted path"):
        import_path("searchrl.core.answers")
    with pytest.raises(RegistryError, match="must be non-empty and contain no ':'"):
        Registry("x").add("a:b", 1)
