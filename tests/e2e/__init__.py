"""End-to-end runs through the hosts' own launchers (tests/trl/test_trl_e2e.py, tests/verl, tests/openrlhf)."""
