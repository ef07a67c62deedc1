"""StePPO as in StepSearch (Wang et al., 2025, §2.3, eq. 1): PPO whose GAE is fed token-level rewards.

The objective and the critic are PPO's (`algorithms.ppo`); what makes it StePPO is where the rewards
land. The global reward r_overall = r_answer + γ_key·r_key sits at the last action token and each search
round's r_step = G − P at that round's last action token (`rewards.stepsearch`, eq. 2-13). GAE then runs
over the action tokens only, so retrieved documents carry no TD error and get no gradient.

An experiment selects it with ``algorithm: {name: steppo}`` and at least one process reward, normally
``rewards: [{name: stepsearch}]``; the ablations are that reward's switches (see its docstring).
StepSearch Appendix B: γ = λ = 1 as in Search-R1's PPO, KL 1e-3, clip 0.2, critic lr 10× the actor's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from searchrl.algorithms.base import Requirements
from searchrl.algorithms.ppo import PPO, PPOConfig

if TYPE_CHECKING:
    from searchrl.core.config import EnvConfig


class StePPO(PPO):
    @classmethod
    def requires(cls, config: PPOConfig, env: EnvConfig) -> Requirements:
        # a per-step reward must be configured (checked with the experiment: `experiment.check_arguments`)
        return replace(super().requires(config, env), process_reward=True)
