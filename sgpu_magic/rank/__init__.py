"""What runs inside a rank process (layer 1): the entry point, the MLflow guard, the exit path. Imports layer 0 only."""
