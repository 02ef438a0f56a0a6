"""TRL, OpenRLHF and veRL integrations of forkrl (not yet implemented; a later issue)."""
