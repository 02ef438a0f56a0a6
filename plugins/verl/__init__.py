"""veRL plugin for forkrl (not yet implemented; a later issue)."""
