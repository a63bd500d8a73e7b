"""What `ostinato calibrate` (planner/calibrate.py) measures inside the running engine, one module
per part of the cost model: timing.py (the clock and the fits all of them use), decode.py (a
token's layer, G_l and C_l(r); forced decode steps, dense), prefill.py (n-token passes, the CPU
pass fit), transfers.py (upload and host-memory read bandwidth)."""
