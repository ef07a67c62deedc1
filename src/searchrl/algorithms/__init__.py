"""Training algorithms. Each one lives in its own module and is registered here by name."""

from searchrl.registry import Registry

ALGORITHMS: Registry[type] = Registry("algorithm")

__all__ = ["ALGORITHMS"]
