"""Command line, settings, Serve-config rendering and the server launcher."""
