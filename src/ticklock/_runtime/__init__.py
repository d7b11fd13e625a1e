"""The runtime: what is due, when to wake, and running a tick."""
