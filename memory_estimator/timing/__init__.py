"""How long a step takes: compute, optimizer and the collectives' alpha-beta cost on a cluster."""
