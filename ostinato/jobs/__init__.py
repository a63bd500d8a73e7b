"""Jobs that run the engine for the planner: `plan`, `calibrate`, `profile` and `skew` (jobs/plan.py), and
the plan `serve` makes for itself under a cap (jobs/serve_plan.py). They sit above both the planner and
the engine's loader (load.py), which uses the planner: kept inside planner/, they made the planner
import the loader back."""
