"""Costs and budgets: what a forward pass costs and how many draft tokens pay.

profile.py    forward time by (rows, tokens per row), measured once per model and machine
roofline.py   the same from a hardware model (named GPUs), and its fit to a measurement
planner.py    the draft budget per batch size from the profile and the calibrated MAT
allocation.py one budget per step shared across the batch by expected acceptance
acceptance.py what a draft node is worth: score ** gamma, fitted per mode and request
step_cost.py  a step's seconds fitted from measured steps (inside vLLM, where no profile is at hand)
projection.py the allocation projected from replayed steps (sssd plan --groundtruth)
"""
