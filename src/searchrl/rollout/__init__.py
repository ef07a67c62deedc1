"""Generation backends and the multi-turn rollout loop."""

from searchrl.rollout.generator import GENERATORS, Generation, Generator, SamplingParams

__all__ = ["GENERATORS", "Generation", "Generator", "SamplingParams"]
