"""The machine and its budget: what the hardware has (hardware.py) and advises (advice.py), what a setup costs
in memory (memory.py, memprobe.py, planner.py) and guards at run time (guard.py), and what passes cost in time
(costcurve.py, profile.py)."""
