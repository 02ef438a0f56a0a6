"""The MoE router load-balancing loss, exact on a prefix tree.

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, Phi-MoE, ...) add
``load_balancing_loss_func`` (Switch Transformer, eqs. 4-6) per forwarded batch ``g`` (a host
micro-batch)::

    aux_g = E * sum_e F_ge * P_ge
    F_ge  = (1 / (L N_g)) sum_{l, t in g} [e in topk(softmax(r_lt))]   (no gradient)
    P_ge  = (1 / (L N_g)) sum_{l, t in g} softmax(r_lt)_e

over the ``L`` MoE layers' router logits ``r_lt`` and the ``N_g`` real tokens of the batch. A
token of a shared prefix counts once per sequence of ``g`` that contains it. On the tree every
token is forwarded once, so each node ``n`` carries its multiplicity ``W[n, g]`` (sequences of
group ``g`` through it). The host adds ``sum_g w_g aux_g``; as ``F`` has no gradient, that is
linear in the probabilities, and its gradient is the one of the surrogate

    sum_n sum_{l, t in n} softmax(r_lt) . A_n,   A_n = E sum_g w_g W[n, g] F_g / (L N_g)

which each unit adds to its backward. ``F`` needs every token's top-k before the first backward,
so the counts come from a no-grad pass: the scoring pass a host loss needs anyway, or one of the
decoder alone (no LM head); packed mode counts inside its one forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UnsupportedModelError
from ..tree import PrefixForest

__all__ = ["RouterLoss", "RouterPass", "token_nodes"]


class RouterLoss:
    """``sum_g weights[g] * aux_g`` over groups of a forest's sequences (module docstring).

    Args:
        weights: one coefficient per group (a host micro-batch): what the host multiplies the
            group's aux loss by before backward (e.g. ``router_aux_loss_coef / accumulation``).

    Before a pass, :meth:`bind` it to the forest and the groups' row boundaries.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        weights = [float(w) for w in weights]
        if not weights or not all(torch.isfinite(torch.tensor(weights))):
            raise ValueError(f"router loss weights must be finite numbers, one per group: got {weights}")
        self.weights = weights
        self.forest: PrefixForest | None = None
        self.counts: torch.Tensor | None = None  # [nodes, E] top-k assignments summed over layers and tokens
        self.probs: torch.Tensor | None = None  # [nodes, E] routing probabilities, same sums (detached)
        self.layers: int | None = None
        self.num_experts = self.top_k = 0

    def bind(self, forest: PrefixForest, group_rows: Sequence[int]) -> RouterLoss:
        """Groups of ``forest``'s sequences: group ``g`` is ``group_rows[g] : group_rows[g + 1]``.

        Returns self, with its counts cleared.
        """
        groups = len(group_rows) - 1
        if groups != len(self.weights) or group_rows[0] != 0 or group_rows[-1] != forest.num_sequences:
            raise ValueError(
                f"router loss: {len(self.weights)} weights for row boundaries {list(group_rows)} of a forest of "
                f"{forest.num_sequences} sequences: give one weight per micro-batch"
            )
        mult = torch.zeros(len(forest.nodes), groups, dtype=torch.float64)
        tokens = torch.zeros(groups, dtype=torch.float64)
        for g in range(groups):
            for s in range(group_rows[g], group_rows[g + 1]):
                mult[forest.paths[s], g] += 1
                tokens[g] += forest.lengths[s]
        self.forest, self.mult, self.tokens = forest, mult, tokens
        self.counts = self.probs = None
        self.layers = None
        self._coef: torch.Tensor | None = None
        return self

    # ------------------------------------------------------------------ model
    def attach(self, model) -> None:
        """Read the expert count and top-k the model passes to its loss (``num_experts``,
        ``num_experts_per_tok`` of the ``*ForCausalLM``, as transformers' MoE heads keep them; a
        vision-language model's forward reads them from its text config)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        experts, top_k = getattr(base, "num_experts", None), getattr(base, "num_experts_per_tok", None)
        if experts is None and top_k is None and hasattr(base.config, "text_config"):
            text = base.config.get_text_config()
            experts, top_k = getattr(text, "num_experts", None), getattr(text, "num_experts_per_tok", None)
        if not isinstance(experts, int) or not isinstance(top_k, int):
            raise UnsupportedModelError(
                f"{type(base).__name__} has no num_experts/num_experts_per_tok for its router load-balancing loss, "
                "so forkrl cannot add it on a tree: set the router loss coefficient to 0, or train without "
                "tree_packing"
            )
        self.num_experts, self.top_k = experts, top_k

    # ------------------------------------------------------------------ results
    @property
    def counted(self) -> bool:
        return self.counts is not None

    def _group_sums(self, per_node: torch.Tensor) -> torch.Tensor:
        """``[G, E]``: per-node sums weighted by multiplicity, over ``L * N_g``."""
        mult, tokens = self.mult.to(per_node.device), self.tokens.to(per_node.device)
        return mult.T @ per_node / (self.layers * tokens)[:, None]

    def coefficients(self) -> torch.Tensor:
        """``[nodes, E]``: ``A_n``, each node's coefficient on its tokens' routing probabilities."""
        if self._coef is None:
            if self.counts is None:
                raise RuntimeError("internal: router coefficients asked for before the counting pass")
            f = self._group_sums(self.counts)  # [G, E]
            device = f.device
            weights = torch.tensor(self.weights, dtype=torch.float64, device=device)
            scale = weights[:, None] / (self.layers * self.tokens.to(device))[:, None]
            self._coef = self.num_experts * self.mult.to(device) @ (scale * f)
        return self._coef

    def values(self) -> torch.Tensor | None:
        """``[G]`` each group's aux loss (unweighted, as the model reports it), or None before a pass."""
        if self.counts is None or self.probs is None:
            return None
        return self.num_experts * (self._group_sums(self.counts) * self._group_sums(self.probs)).sum(-1)


class RouterPass:
    """What one forward records from the router logits, for one pass of :class:`RouterLoss`.

    Args:
        loss: the bound loss.
        count: record top-k counts and probability sums (a no-grad pass before the backward);
            otherwise form each unit's surrogate term (a gradient pass; probabilities recorded too).
        device: where the sums live (the model's: no host sync per forward).
    """

    def __init__(self, loss: RouterLoss, count: bool, device: torch.device | str = "cpu") -> None:
        self.loss, self.count = loss, count
        if count:
            n, e = len(loss.forest.nodes), loss.num_experts
            loss.counts = torch.zeros(n, e, dtype=torch.float64, device=device)
            loss.probs = torch.zeros(n, e, dtype=torch.float64, device=device)
            loss._coef = None
        elif loss.counts is None:
            raise RuntimeError("internal: a router gradient pass needs the counting pass first")
        else:
            loss.probs = torch.zeros_like(loss.counts)

    def wants(self) -> bool:
        """Whether the forward now should return its router logits (counting, or with grad)."""
        return self.count or torch.is_grad_enabled()

    def record(self, logits: Sequence[torch.Tensor], token_nodes: torch.Tensor) -> torch.Tensor | None:
        """Record one forward's router logits.

        Args:
            logits: per MoE layer ``[T, E]`` router logits, one row per forwarded token (a padded
                batch flattened row-major).
            token_nodes: ``[T]`` the forest node of each row's token, -1 for padding.

        Returns:
            The surrogate scalar to backpropagate with gradient 1 (gradient pass), else None.
        """
        loss = self.loss
        if not logits:
            raise UnsupportedModelError(
                "the model returned no router logits (output_router_logits=True), so its router load-balancing "
                "loss cannot be formed on a tree: set the router loss coefficient to 0, or train without "
                "tree_packing"
            )
        if loss.layers is None:
            loss.layers = len(logits)
        elif loss.layers != len(logits):
            raise RuntimeError(f"internal: router logits of {len(logits)} layers, earlier {loss.layers}")
        device = logits[0].device
        nodes = token_nodes.to(device)
        valid = (nodes >= 0)[:, None]
        nodes = nodes.clamp(min=0)
        acc = torch.float64 if logits[0].dtype == torch.float64 else torch.float32
        sums = torch.zeros(len(nodes), loss.num_experts, dtype=acc, device=device)  # [T, E] over layers
        hits = torch.zeros_like(sums) if self.count else None
        for r in logits:
            sums = sums + torch.softmax(r.to(acc), -1) * valid
            if hits is not None:  # as transformers: top-k of the softmax in the logits' dtype
                top = torch.softmax(r.detach(), -1).topk(loss.top_k, dim=-1).indices
                hits.scatter_add_(1, top, valid.to(acc).expand(-1, loss.top_k).contiguous())
        at = nodes.to(loss.probs.device)
        loss.probs.index_add_(0, at, sums.detach().to(loss.probs.device, torch.float64))
        if hits is not None:
            loss.counts.index_add_(0, at, hits.to(loss.counts.device, torch.float64))
            return None
        coef = loss.coefficients().to(device=device, dtype=acc)[nodes]
        return (sums * coef).sum()


def token_nodes(nodes: Sequence[int], lengths: Sequence[int], width: int) -> torch.Tensor:
    """``[len(nodes) * width]``: the node of each token of a right-padded batch, -1 for padding."""
    out = torch.full((len(nodes), width), -1, dtype=torch.long)
    for b, (n, k) in enumerate(zip(nodes, lengths, strict=True)):
        out[b, :k] = n
    return out.view(-1)
