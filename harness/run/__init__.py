"""Running implementations: the checker and its loop, the benchmark and its timer, warming long
searches, host overhead, Nsight Compute counters and model training."""
