"""SLO tuning: workloads from real traces, the load generator, goodput, the profiler, the simulator
and the placement search (DistServe-style, with n:m ratios and the KV transfer in the model)."""
