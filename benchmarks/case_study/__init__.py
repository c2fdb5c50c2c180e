"""The Llama-3-70B case study: its rounds, its serve sweep and its story."""
