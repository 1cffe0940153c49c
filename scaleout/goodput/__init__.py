"""Goodput: what keeps a job training -- preflight and diagnosis (doctor), node quarantine, the
verdict a failed job writes, preemption and requeue."""
