"""MLX benchmark: decode speed of mlx-lm's full cache vs trikv's bounded MLX cache (`speed.py`), agreement with the
torch path and quantised fidelity (`fidelity.py`), and its page (`page.py`). Run: `python -m trikv.benchmarks.mlx`."""
