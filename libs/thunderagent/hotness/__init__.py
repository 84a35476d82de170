"""Hot-prefix counting over a sliding window (pure, clock injected)."""

from thunderagent.hotness.counter import HotPrefixCounter

__all__ = ["HotPrefixCounter"]
