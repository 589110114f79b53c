"""MLflow (layer 4): the run per job, tracking URIs, the MLflow UI server."""
