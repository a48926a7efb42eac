"""Experiments: launch ledgers and TTFT of each eager-boundary variant (the seeds' measurements, rebuilt)."""
