"""The application layer: the command line, runs (plan, train, evaluation), sweeps, reports, the viewer and
the model server."""
