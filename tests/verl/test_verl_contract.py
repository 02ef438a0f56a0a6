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


def test_a_probe_names_the_function_and_what_changed():
    """The probes' two checks (:mod:`forkrl.core.compat.probes`) fail on a changed veRL function with
    its name and what is gone, and the entry's check says which private that is."""
    from verl.workers.engine import utils

    from forkrl.core.compat.probes import reads, takes

    with pytest.raises(
        AssertionError, match=r"postprocess_batch_func takes \['output_lst', 'indices', 'data'\]"
    ):
        takes(utils.postprocess_batch_func, "output_lst", "indices", exact=True)
    takes(utils.postprocess_batch_func, "output_lst", "indices")
    assert "def postprocess_batch_func" in reads(utils.postprocess_batch_func, "indices")
    with pytest.raises(AssertionError, match=r"postprocess_batch_func no longer holds \['no such line'\]"):
        reads(utils.postprocess_batch_func, "indices", "no such line")
    broken = Private(
        "veRL", "postprocess_batch_func", "a test", lambda: reads(utils.postprocess_batch_func, "gone"), "x"
    )
    with pytest.raises(
        AssertionError, match=r"veRL changed: postprocess_batch_func .*no longer holds \['gone'\]"
    ):
        broken.check()
