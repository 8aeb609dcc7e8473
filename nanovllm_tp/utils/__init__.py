"""Small pieces every part uses: value checks with clear messages (checks.py), the per-step forward context
(context.py) and the tracer (trace.py)."""
