"""The ``thunderagent`` command."""
