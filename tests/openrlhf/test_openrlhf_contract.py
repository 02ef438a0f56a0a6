"""Every OpenRLHF name the plugin swaps and every private it relies on
(:data:`forkrl.plugins.openrlhf.compat.PRIVATES`, the swaps first) is where the plugin expects it in the
installed OpenRLHF: one test per entry, so an upgrade that moves one fails here with the entry's name
and reason."""

from __future__ import annotations

import pytest

from forkrl.core.compat import Private
from forkrl.plugins import deepspeed as forkrl_deepspeed
from forkrl.plugins.openrlhf import compat


@pytest.mark.parametrize("private", compat.PRIVATES, ids=lambda p: p.name)
def test_openrlhf_private_is_where_the_plugin_expects_it(private):
    assert isinstance(private, Private) and private.host == "OpenRLHF"
    private.check()


@pytest.mark.parametrize("private", forkrl_deepspeed.PRIVATES, ids=lambda p: p.name)
def test_deepspeed_private_is_where_the_plugin_expects_it(private):
    """What forkrl's ZeRO-3 gathering relies on in the DeepSpeed OpenRLHF trains with (a real partition
    needs a process group: the DeepSpeed tests check that part on one)."""
    assert isinstance(private, Private) and private.host == "DeepSpeed"
    assert private.checked == forkrl_deepspeed.CHECKED
    private.check()


def test_only_listed_names_are_swapped():
    """:func:`compat.swapped` refuses a name :data:`compat.SWAPS` does not list, and restores what it swapped."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    assert all(swap in compat.PRIVATES for swap in compat.SWAPS)
    with pytest.raises(AssertionError, match="not listed in compat.SWAPS"):
        with compat.swapped(ppo_actor, PolicyModelActorTypo=object):
            pass
    original = ppo_actor.PolicyModelActor
    with compat.swapped("openrlhf.trainer.ray.ppo_actor", PolicyModelActor=object):
        assert ppo_actor.PolicyModelActor is object
    assert ppo_actor.PolicyModelActor is original
