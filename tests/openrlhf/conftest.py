"""The one-rank gloo group OpenRLHF's trainers train in, started before the tests run:
:func:`forkrl.plugins.openrlhf.testing.start`."""


def pytest_configure(config) -> None:
    from forkrl.plugins.openrlhf import testing

    testing.start()
