"""Expert health: is every expert of every MoE layer still getting tokens?

A mixture of experts can degrade quietly: the router sends most tokens to a few experts and the
others stop learning ("dead" experts). From the routing statistics of each training forward
(`LossOutput.moe`: slots per expert and router entropy, per layer), summed over the micro-batches,
steps and ranks of one log window, this gives per layer:

- ``moe/layer_{i}/max_expert_share``: the largest share of the layer's routed slots one expert
  got (1/E when balanced, 1 when everything goes to one expert);
- ``moe/layer_{i}/router_entropy``: mean entropy (nats) of the router's distribution per token
  (log E: undecided; near 0: every token sure of its experts);
- ``moe/layer_{i}/dead_experts``: experts that received no token in the whole window;

and a warning line naming the experts that died since the previous window. The counts stay on
the device between log steps; the one host sync (and one all-reduce across ranks) is at the log
step, so `report` is collective: every rank calls it at the same steps.
"""

from __future__ import annotations

import torch

from lmforge.distributed.dist import all_reduce_sum


class ExpertHealth:
    def __init__(self):
        self._counts: torch.Tensor | None = None  # [L, E] slots routed to each expert, this window
        self._entropy: torch.Tensor | None = None  # [L] summed over forwards
        self._forwards = 0
        self._steps = 0
        self._dead: set[tuple[int, int]] = set()  # (layer, expert) dead in the previous window

    def add(self, moe: dict[str, torch.Tensor]) -> None:
        """One training forward's statistics (no host sync)."""
        counts, entropy = moe["moe_tokens_per_expert"], moe["moe_router_entropy"].float()
        self._counts = counts.clone() if self._counts is None else self._counts + counts
        self._entropy = entropy.clone() if self._entropy is None else self._entropy + entropy
        self._forwards += 1

    def step(self) -> None:
        self._steps += 1

    def report(self, log) -> dict[str, float]:
        """The window's metrics, all ranks together; starts a new window. Collective."""
        if self._counts is None:
            return {}
        counts = all_reduce_sum(self._counts.double())
        forwards = all_reduce_sum(torch.tensor(float(self._forwards), device=counts.device))
        entropy = (all_reduce_sum(self._entropy.double()) / forwards).tolist()
        share = (counts.max(dim=1).values / counts.sum(dim=1).clamp(min=1)).tolist()
        zero = (counts == 0).tolist()
        metrics: dict[str, float] = {}
        dead = set()
        for layer in range(len(share)):
            layer_dead = [e for e, z in enumerate(zero[layer]) if z]
            dead.update((layer, e) for e in layer_dead)
            metrics[f"moe/layer_{layer}/max_expert_share"] = share[layer]
            metrics[f"moe/layer_{layer}/router_entropy"] = entropy[layer]
            metrics[f"moe/layer_{layer}/dead_experts"] = float(len(layer_dead))
            newly = [e for e in layer_dead if (layer, e) not in self._dead]
            if newly:
                log(f"warning: MoE layer {layer}: expert(s) {', '.join(map(str, newly))} received no tokens in "
                    f"the last {self._steps} step(s) ({len(layer_dead)} of {len(zero[layer])} experts idle); "
                    "consider a larger model.moe_aux_loss_coef")
        metrics["train/moe_max_expert_share"] = max(share)
        metrics["train/moe_dead_experts"] = float(len(dead))
        self._dead = dead
        self._counts = self._entropy = None
        self._forwards = self._steps = 0
        return metrics
