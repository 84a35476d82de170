"""The scheduler service refuses what it cannot carry out."""

import pytest

from thunderagent.scheduler.service import SchedulerConfig, SchedulerService


def test_live_service_refuses_pd_disaggregation_it_cannot_execute():
    with pytest.raises(ValueError, match="PD disaggregation"):
        SchedulerService(SchedulerConfig(scheduler="pd_capped"), bus=None)


def test_live_service_accepts_the_colocated_presets():
    for name in ("thunder", "fcfs", "priority_srpt", "preempt", "direct"):
        assert SchedulerService(SchedulerConfig(scheduler=name), bus=None).core is not None
