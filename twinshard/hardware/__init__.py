"""Hardware: the chip table (peaks, memory, links) and TPU/GPU topologies."""
