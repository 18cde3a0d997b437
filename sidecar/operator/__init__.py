"""An operator's read and reset of one descriptor's counters: through the decision path's own
matching and counter names (`counter_admin.py`), on a listener of its own (`port.py`), asked by
the `counters` command (`commands.py`).
"""
