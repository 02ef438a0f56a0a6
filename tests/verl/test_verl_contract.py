"""Every veRL private the veRL plugin relies on (:data:`forkrl.plugins.verl.compat.PRIVATES`) is where
the plugin expects it in the installed veRL: one test per entry, so an upgrade that moves one fails
here with the entry's name and reason."""

from __future__ import annotations

import pytest

from forkrl.core.compat import Private
from forkrl.plugins.verl import compat


@pytest.mark.parametrize("private", compat.PRIVATES, ids=lambda p: p.name)
def test_verl_private_is_where_the_plugin_expects_it(private):
    assert isinstance(private, Private) and private.host == "veRL" and private.checked == compat.CHECKED
    private.check()
