"""Scheduler service: owns the waiting queue and hands requests to workers."""
