"""One registry type for retrievers, rewards, algorithms, generators and judges.

Entries are either objects registered with the decorator, or *lazy* entries: a
``"package.module:attr"`` string imported on first use, so that names can be checked
(``searchrl validate``) before torch or faiss are imported. A name that contains ``:``
is always treated as a dotted path to a user object, e.g. ``my_pkg.rewards:retrieval_hit``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from searchrl.core.errors import RegistryError, close_match

T = TypeVar("T")


def import_path(path: str) -> Any:
    """Import ``package.module:attr`` (attr may be dotted)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RegistryError(f"'{path}' is not a dotted path of the form 'package.module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own error (a SyntaxError in a user's reward file)
        raise RegistryError(
            f"cannot import module '{module_name}' for '{path}': {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RegistryError(f"module '{module_name}' has no attribute '{attr}' (from '{path}')")
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Name -> object. Registering the same name twice is an error."""

    def __init__(self, kind: str, sources: tuple[str, ...] = ()) -> None:
        """``sources``: modules whose definitions register themselves (a decorator at each definition), imported at
        the first lookup (the policy losses' module loads without torch, so their names are read without it)."""
        self.kind = kind
        self._objects: dict[str, T] = {}
        self._lazy: dict[str, str] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._sources, self._source_names = list(sources), frozenset(sources)

    def _load(self) -> None:
        while self._sources:
            importlib.import_module(self._sources.pop(0))

    # ----------------------------------------------------------------- registration
    def _claim(self, name: str) -> None:
        if not name or ":" in name:
            raise RegistryError(f"{self.kind} name {name!r} must be non-empty and contain no ':'")
        if name in self._objects or name in self._lazy:
            raise RegistryError(f"{self.kind} '{name}' is already registered")

    def register(self, name: str, **meta: Any) -> Callable[[T], T]:
        """Decorator: ``@REG.register("bm25")``."""

        def deco(obj: T) -> T:
            self.add(name, obj, **meta)
            return obj

        return deco

    def add(self, name: str, obj: T, **meta: Any) -> None:
        self._claim(name)
        self._objects[name] = obj
        self._meta[name] = dict(meta)

    def add_defined(self, name: str, obj: T) -> None:
        """Register ``obj`` where it is defined (a decorator at its definition in one of ``sources``); importing
        the module again is not a clash. An object defined elsewhere (a user's module) is not registered: it is
        named by its dotted path, so the registry's names do not depend on what has been imported."""
        if getattr(obj, "__module__", None) not in self._source_names:
            return
        prev = self._objects.get(name)
        key = (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
        if (
            prev is not None
            and (getattr(prev, "__module__", None), getattr(prev, "__qualname__", None)) == key
        ):
            self._objects[name] = obj
            return
        self.add(name, obj)

    def add_lazy(self, name: str, target: str, **meta: Any) -> None:
        """Register ``name`` -> ``"package.module:attr"`` without importing it."""
        self._claim(name)
        self._lazy[name] = target
        self._meta[name] = dict(meta)

    # ----------------------------------------------------------------- lookup
    def names(self) -> list[str]:
        self._load()
        return sorted({*self._objects, *self._lazy})

    def __contains__(self, name: object) -> bool:
        self._load()
        return isinstance(name, str) and (name in self._objects or name in self._lazy or ":" in name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def meta(self, name: str) -> dict[str, Any]:
        self._load()
        return self._meta.get(name, {})

    def check(self, name: object) -> None:
        """Raise RegistryError unless ``name`` is known (dotted paths are imported to check them)."""
        self._load()
        if isinstance(name, str) and ":" in name:
            import_path(name)
            return
        if not isinstance(name, str) or (name not in self._objects and name not in self._lazy):
            guess = close_match(name, self.names())
            msg = f"unknown {self.kind} {name!r}; valid: {', '.join(self.names()) or '(none)'}"
            if guess:
                msg += f"; did you mean '{guess}'?"
            raise RegistryError(msg)

    def get(self, name: str) -> T:
        self._load()
        if ":" in name:
            return import_path(name)
        if name in self._objects:
            return self._objects[name]
        if name in self._lazy:
            obj = import_path(self._lazy[name])
            # the import may itself have registered the object under the same name
            self._objects.setdefault(name, obj)
            return self._objects[name]
        self.check(name)
        raise AssertionError("unreachable")  # check() raised

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
