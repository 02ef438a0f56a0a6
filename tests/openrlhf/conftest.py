"""The one-rank gloo group OpenRLHF's trainers train in, started before the tests run:
:func:`forkrl.plugins.openrlhf.testing.start`."""


def pytest_configure(config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no test, and its workers would inherit its group's port
    from forkrl.plugins.openrlhf import testing

    testing.start()
