"""Test-only CPU stand-ins for the hosts' GPU-only parts (rollout servers, device patches) so that their real
launchers run end to end on a CPU machine in CI; nothing in core/ or plugins/ imports it."""
