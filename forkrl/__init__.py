"""forkrl: cheaper RL post-training of language models, as plugins for TRL, OpenRLHF and veRL.

The library lives in ``forkrl.core`` (repo folder ``core/``) and the host integrations in
``forkrl.plugins.<host>`` (repo folder ``plugins/<host>/``).
"""

__version__ = "0.1.0"
