"""FP8 block-scaled (e4m3, 128 x 128 weight blocks): config.py, formats.py (the checkpoint format), linear.py, experts.py, dispatch.py."""
