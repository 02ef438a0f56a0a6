"""veRL on the CPU in this process (its platform, engine device, a one-rank gloo group, forkrl's
engine registered) before any test module imports veRL: :func:`forkrl.plugins.verl.testing.start`."""


def pytest_configure(config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller runs no test, and its workers would inherit its group's port
    from forkrl.plugins.verl import testing

    testing.start()
