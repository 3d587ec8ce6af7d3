"""Shipyard's front end: the spec -> dvc.yaml compiler, the CLI, verification."""
