"""INT4 weight-only (W4A16): config.py (the checkpoint formats a config names), formats.py, linear.py, experts.py, dispatch.py."""
