"""Which plan: every plan's bytes at its peak, the verdict, what drove it, and the fastest plan that fits."""
