"""The in-rank runtime: environment detection, bootstrap, config and engine."""
