"""Prefix forests, their execution plan, and host row layouts.

- :mod:`.forest`: :class:`PrefixForest`, a batch of sequences as a compressed trie with the maps
  between sequences and node tokens.
- :mod:`.plan`: the forest's nodes cut into execution units (blocks), or short internal nodes
  copied into their children (:func:`collapsed`).
- :mod:`.layout`: host micro-batch layouts <-> per-sequence tokens and scored spans.
"""

from .forest import PrefixForest, TreeNode
from .layout import RowLayout, Window
from .plan import Unit, collapsed, plan

__all__ = ["PrefixForest", "RowLayout", "TreeNode", "Unit", "Window", "collapsed", "plan"]
