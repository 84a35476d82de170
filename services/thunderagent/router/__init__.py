"""Router service: prompt to token ids, ranked workers, hand-off to the scheduler."""
