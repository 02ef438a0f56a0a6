"""Every TRL, transformers-Trainer and accelerate private the TRL plugin relies on
(:data:`forkrl.plugins.trl.compat.PRIVATES`) is where the plugin expects it in the installed TRL: one
test per entry, so an upgrade that moves one fails here with the entry's name and reason."""

from __future__ import annotations

import pytest

from forkrl.core.compat import Private
from forkrl.plugins import deepspeed as forkrl_deepspeed
from forkrl.plugins.trl import compat


@pytest.mark.parametrize("private", compat.PRIVATES, ids=lambda p: p.name)
def test_trl_private_is_where_the_plugin_expects_it(private):
    assert isinstance(private, Private) and private.host in ("TRL", "accelerate")
    private.check()


@pytest.mark.parametrize("private", forkrl_deepspeed.PRIVATES, ids=lambda p: p.name)
def test_deepspeed_private_is_where_the_plugin_expects_it(private):
    """What forkrl's ZeRO-3 gathering relies on in the DeepSpeed TRL trains with (a real partition
    needs a process group: the DeepSpeed tests check that part on one)."""
    assert isinstance(private, Private) and private.host == "DeepSpeed"
    assert private.checked == forkrl_deepspeed.CHECKED
    private.check()


def test_trl_privates_are_where_the_plugin_expects_them():
    """Every entry at once, the failures listed together (a TRL upgrade usually moves several)."""
    failures = []
    for private in compat.PRIVATES:
        try:
            private.check()
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, f"TRL changed (checked against {compat.CHECKED}):\n" + "\n".join(failures)


def test_entropy_bonus_is_read_without_a_default():
    """tree_balance reads GRPO's ``_entropy_bonus_enabled`` through the registry: a trainer that lacks
    it raises instead of reading as off (RLOO has no entropy bonus)."""
    import trl

    class Renamed:
        pass

    with pytest.raises(AttributeError, match="_entropy_bonus_enabled"):
        compat.entropy_bonus_enabled(Renamed())
    assert compat.entropy_bonus_enabled(trl.RLOOTrainer.__new__(trl.RLOOTrainer)) is False
