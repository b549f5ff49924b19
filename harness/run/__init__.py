"""Running implementations: the checker and its loop, the benchmark and its timer, warming long
searches, host overhead, Nsight Compute counters and model training; and the fan-out of a command
over GPUs or a SLURM cluster (shard.py plans it, fanout.py runs and merges it)."""
