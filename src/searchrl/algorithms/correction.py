"""Sampler-trainer (rollout) correction: importance weights and rejection masks between the policy that
sampled a token (the behaviour policy μ, whose log-probs the generator recorded) and the trainer's π_old.

The three-policy ("decoupled") PPO objective of Hilton et al. (2021), as AReaL (Fu et al., 2025, eq. 5) and
verl's ``rollout_corr`` state it:

    ℓ_t = −w_t · min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t),   r_t = π_θ / π_old,   w_t from ρ_t,

with ρ_t = π_old(a_t | s_t) / μ(a_t | s_t). π_old (the proximal policy) is recomputed by the trainer, so the
clip bounds the update against the trainer's own weights while w corrects for the sampler: another backend
(vLLM's kernels, bf16), or older weights (an asynchronous worker). The weight w is a constant (no gradient).

Modes (verl's ``rollout_corr`` definitions, docs/algo/rollout_corr_math.md §3.3-3.4, Liu, Li et al. 2025,
"When Speed Kills Stability"):

- ``token_tis``: w_t = min(ρ_t, C), truncated token IS (``rollout_is: token``, C = ``clip``, 2 in verl);
- ``seq_tis``: w = min(Π_t ρ_t, C) over the sequence's action tokens (``rollout_is: sequence``);
- ``token_mask``: w_t = 1 if low ≤ ρ_t ≤ high else 0 (``rollout_rs: token``);
- ``seq_mask``: w = 1 if low ≤ Π_t ρ_t ≤ high else 0, the whole sequence (``rollout_rs: sequence``);
- ``geo_mask``: w = 1 if low ≤ exp(mean_t log ρ_t) ≤ high else 0 (``rollout_rs: geometric``; SkyRL
  uses [0.99, 1.01], verl's preset 1.001);
- ``none``: w = 1; the mismatch metrics are still logged.

``low`` defaults to 1 / ``high``. By default (``rejected: keep``) a rejected token (w = 0) adds nothing to the
policy loss but still counts in the loss normaliser; the advantages and the value loss are computed on the
unchanged mask. verl instead removes rejected tokens from the response mask, so its normaliser counts fewer
tokens. The two differ by more than a scale: with ``loss_agg: token-mean`` every token's gradient is the
same multiple of verl's (N / N_kept, so the direction is verl's); with ``seq-mean-token-mean`` each sequence
gets its own factor (its tokens / its kept tokens), so the direction differs (2 of 4 tokens of one row
rejected: that row's gradient is 0.5× verl's, a row with none rejected 1×). ``rejected: drop`` is verl's:
rejected tokens leave the normaliser too (the trainer then computes π_old in a no-grad pass of its own, as
verl does, so that the rejections are known before the update's first micro-batch).

**The KL term to the reference is weighted too** (``weight_kl``, on by default once a mode is set). Every
estimator of KL(π_θ ‖ π_ref) from sampled tokens (k1, k2, k3) is an expectation over a_t ~ π_θ, but the
tokens came from μ: the importance weight π_θ / μ ≈ w_t turns E_μ[w · k] back into the expectation under
π_θ. Unweighted, the estimate and its gradient are biased, worst where the sampler is stale: a token that μ
(say the reference itself, version 0) sampled and π_θ has since learned to avoid has ρ = π_θ / μ small and
k3 = π_ref/π_θ − log(π_ref/π_θ) − 1 ≈ 1/ρ, with a gradient (1 − π_ref/π_θ) ∇log π_θ of the same size; weighted,
ρ · k3 = 1 − ρ + ρ log ρ, below 1 for every ρ ≤ e (so everywhere under the clip 2). (At ``max_staleness: 4`` on the quickstart the unweighted k3 rose to 1-9 per
token within 3-5 steps while KL(μ ‖ π_old) stayed at 0.03-0.1; benchmarks/results/staleness.md.) The
logged ``train/kl`` is then the weighted estimate (what the loss adds, and what the collapse guard reads),
``train/kl_unweighted`` the plain one. With ``kl_in: reward`` the penalty is part of the reward, so the
policy loss's weight already carries it; the logged ``kl/sequence`` (and PPO's adaptive β, which follows it)
is weighted. ``weight_kl: false`` weights the policy loss only, as verl's truncated IS modes do (its mask
modes drop rejected tokens from the KL term as well).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from searchrl.core.config import AT_LEAST_1, setting

if TYPE_CHECKING:  # imported where it runs: the section (`RolloutCorrection`) loads without torch
    import torch

Mode = Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask", "geo_mask"]
MODES: tuple[str, ...] = ("none", "token_tis", "seq_tis", "token_mask", "seq_mask", "geo_mask")
MASK_MODES: tuple[str, ...] = ("token_mask", "seq_mask", "geo_mask")
_DEFAULT_HIGH = {"token_mask": 2.0, "seq_mask": 2.0, "geo_mask": 1.01}
_LOG_CAP = 20.0  # log-ratios held to ±20 before an exp, as the clipped loss does


@dataclass(frozen=True)
class RolloutCorrection:
    """``algorithm.rollout_correction`` of the online algorithms (GRPO, PPO, StePPO, SLATE)."""

    mode: Mode = setting(
        "none",
        "none: the papers' objective (π_old recomputed, no weight; the metrics still log); token_tis, "
        "seq_tis: truncated importance weights; token_mask, seq_mask, geo_mask: rejection masks",
    )
    clip: float = setting(
        2.0, "C of the truncated IS modes (verl's rollout_is_threshold 2, SkyRL's TIS clip 2)", AT_LEAST_1
    )
    high: float | None = setting(None, "upper bound of the mask modes; null: 2 (token, seq), 1.01 (geo)")
    low: float | None = setting(None, "lower bound of the mask modes; null: 1 / high")
    weight_kl: bool = setting(
        True,
        "the KL term to the reference and its logged estimate weighted by w too; false: the policy loss only "
        "(verl's token_tis / seq_tis)",
    )
    rejected: Literal["keep", "drop"] = setting(
        "keep",
        "rejected tokens of the mask modes: keep (in the loss normaliser, w = 0) or drop (out of it, verl's)",
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rollout_correction.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.clip >= 1.0 or math.isinf(self.clip):
            raise ValueError(
                f"rollout_correction.clip must be a finite number >= 1 (verl uses 2), got {self.clip}"
            )
        if self.rejected not in ("keep", "drop"):
            raise ValueError(f"rollout_correction.rejected must be 'keep' or 'drop', got {self.rejected!r}")
        if self.rejected == "drop" and self.mode not in MASK_MODES:
            raise ValueError(
                f"rollout_correction.rejected: drop applies to the mask modes ({', '.join(MASK_MODES)}), "
                f"which reject tokens; mode {self.mode!r} rejects none"
            )
        high, low = self.bounds()
        if not 0.0 < low <= 1.0 <= high or math.isinf(high):
            raise ValueError(
                f"rollout_correction needs 0 < low <= 1 <= high < inf (a mask keeps ratios in [low, high]), "
                f"got low {low}, high {high}"
            )

    @property
    def drops(self) -> bool:
        """Whether rejected tokens leave the loss normaliser (``rejected: drop``)."""
        return self.rejected == "drop"

    def bounds(self) -> tuple[float, float]:
        """(high, low) of the mask modes with the defaults filled in."""
        high = self.high if self.high is not None else _DEFAULT_HIGH.get(self.mode, 2.0)
        low = self.low if self.low is not None else 1.0 / high
        return high, low


def correction_weights(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cfg: RolloutCorrection
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weights w (B, T), 0 outside ``mask`` (the action tokens), and per-sequence diagnostics {name: (B,)}:
    action tokens, Σ k3 KL, Σ log ρ, tokens truncated or rejected, whether any was, Σ w and Σ w²."""
    import torch

    mask = mask.to(old_logp.dtype)
    log_rho = ((old_logp - behaviour_logp) * mask).detach()
    tokens = mask.sum(-1)
    seq_log_rho = log_rho.sum(-1)
    rho = torch.exp(log_rho.clamp(-_LOG_CAP, _LOG_CAP))
    high, low = cfg.bounds()
    mode = cfg.mode
    if mode == "token_tis":
        w = rho.clamp(max=cfg.clip)
        cut = (rho > cfg.clip).to(mask.dtype)
    elif mode == "token_mask":
        w = ((rho >= low) & (rho <= high)).to(mask.dtype)
        cut = 1.0 - w
    elif mode in ("seq_tis", "seq_mask", "geo_mask"):
        if mode == "geo_mask":
            stat = torch.exp(seq_log_rho / tokens.clamp(min=1.0))
        else:
            stat = torch.exp(seq_log_rho.clamp(-_LOG_CAP, _LOG_CAP))
        if mode == "seq_tis":
            seq_w, seq_cut = stat.clamp(max=cfg.clip), stat > cfg.clip
        else:
            keep = (stat >= low) & (stat <= high)
            seq_w, seq_cut = keep.to(mask.dtype), ~keep
        w = seq_w[:, None].expand_as(mask)
        cut = seq_cut.to(mask.dtype)[:, None].expand_as(mask)
    else:
        w = torch.ones_like(mask)
        cut = torch.zeros_like(mask)
    w, cut = w * mask, cut * mask
    stats = {
        "tokens": tokens,
        # k3 estimate of KL(μ ‖ π_old) per token, summed over the sequence: ρ − log ρ − 1 (verl §4.1)
        "k3_kl": ((rho - log_rho - 1.0) * mask).sum(-1),
        "log_ratio": seq_log_rho,
        "cut_tokens": cut.sum(-1),
        "cut_seq": (cut.sum(-1) > 0).to(mask.dtype),
        "w_sum": w.sum(-1),
        "w_sq_sum": (w**2).sum(-1),
    }
    return w.detach(), stats


def effective_sample_size(w_sum: float, w_sq_sum: float, n: float) -> float:
    """Normalised effective sample size of token weights, (Σw)² / (n Σw²) ∈ (0, 1] (Kong, 1992); 1 when
    every weight is equal."""
    if n <= 0 or w_sq_sum <= 0:
        return 1.0
    return w_sum**2 / (n * w_sq_sum)
