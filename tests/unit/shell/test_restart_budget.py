"""`up` restarts a child that exits, until it has exited too often in a window."""

from thunderagent.stack.up import RestartBudget


def test_each_child_has_its_own_budget_in_a_sliding_window() -> None:
    budget = RestartBudget(max_restarts=2, window_s=60.0)
    assert budget.spend("router-0", 0.0) and budget.spend("router-0", 10.0)
    assert not budget.spend("router-0", 20.0)  # a third exit within the minute: give up
    assert budget.spend("engine-0", 20.0)  # another child is not charged
    assert budget.spend("router-0", 61.0)  # the first exit has left the window
