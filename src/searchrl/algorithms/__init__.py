"""Training algorithms. Each one lives in its own module and is registered here by name."""

from searchrl.registry import Registry

ALGORITHMS: Registry[type] = Registry("algorithm")
# Lazy so that configs can be validated without importing torch.
ALGORITHMS.add_lazy("sft", "searchrl.algorithms.sft:SFT")
ALGORITHMS.add_lazy("grpo", "searchrl.algorithms.grpo:GRPO")
ALGORITHMS.add_lazy("ppo", "searchrl.algorithms.ppo:PPO")
ALGORITHMS.add_lazy("steppo", "searchrl.algorithms.steppo:StePPO")
ALGORITHMS.add_lazy("slate", "searchrl.algorithms.slate:SLATE")
ALGORITHMS.add_lazy("dpo", "searchrl.algorithms.dpo:DPO")
ALGORITHMS.add_lazy("prm", "searchrl.algorithms.prm:PRM")

__all__ = ["ALGORITHMS"]
