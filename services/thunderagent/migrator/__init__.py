"""The migration service: hot prefixes replicated and moved between workers."""
