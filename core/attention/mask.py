"""The attention mask of a packed prefix forest.

Nodes are in depth-first pre-order, so every subtree is one contiguous run of the packed tokens. A
token attends to every earlier token of its own node and to every token of its ancestors: exactly
the earlier tokens ``k`` whose node's subtree contains it. With ``subtree_end[k]`` the packed
offset one past the last token of the subtree of ``k``'s node,

    attends(q, k) = (k <= q) and (q < subtree_end[k])

which is FlexAttention's ``mask_mod`` form as well as the dense boolean mask below.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["subtree_ends", "tree_mask"]


def subtree_ends(node_lengths: list[int], parents: list[int]) -> torch.Tensor:
    """``[total]`` packed offset one past the end of each token's node's subtree.

    Args:
        node_lengths: tokens per node, nodes in pre-order.
        parents: parent index per node (-1 for a root); a parent precedes its children.
    """
    starts = [0]
    for n in node_lengths:
        starts.append(starts[-1] + n)
    end = starts[1:]  # a node's subtree end, grown by its descendants (children come later)
    for i in range(len(parents) - 1, -1, -1):
        p = parents[i]
        if p >= 0:
            end[p] = max(end[p], end[i])
    return torch.from_numpy(np.repeat(np.asarray(end, dtype=np.int64), node_lengths))  # host: no tensor op


def tree_mask(ends: torch.Tensor) -> torch.Tensor:
    """Dense ``[total, total]`` boolean mask (True: attend) from :func:`subtree_ends`."""
    pos = torch.arange(len(ends), device=ends.device)
    q, k = pos[:, None], pos[None, :]
    return (k <= q) & (q < ends[None, :])
